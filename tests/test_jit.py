"""csrc_cute/jit.py: compile keys, the in-memory cache, and the disk cache of exported kernels.

The disk tests compile a real (tiny) CuTe kernel for sm_90a in child processes; on this CPU machine the
kernel is compiled without a JIT engine (``no_jit_engine=True``: nothing to load it on), which is what
lets it be exported. A later child loading it back must not call the build at all."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from csrc_cute import jit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = '''
import cutlass.cute as cute
from cutlass import Float32, Int32

from csrc_cute.jit import KernelFamily, compiler

from .helpers import SCALE

FAMILY = KernelFamily("probe", (__name__,))


@cute.kernel
def _scale_kernel(a: cute.Tensor, b: cute.Tensor, n: Int32):
    i = cute.arch.thread_idx()[0] + cute.arch.block_idx()[0] * 128
    if i < n:
        b[i] = a[i] * SCALE


@cute.jit
def _scale_launch(a: cute.Tensor, b: cute.Tensor, n: Int32, stream):
    _scale_kernel(a, b, n).launch(grid=(1, 1, 1), block=(128, 1, 1), stream=stream)


def compiled(builds: list):
    def build():
        builds.append(1)
        n = cute.sym_int()
        fake = [cute.runtime.make_fake_compact_tensor(Float32, (n,), assumed_align=16) for _ in range(2)]
        return cute.compile(_scale_launch, *fake, Int32(0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                            options="--enable-tvm-ffi", no_jit_engine=True)
    return FAMILY.compiled(("scale", 128), build)


@compiler
def scaled(n: int):
    """The same kernel under the key ("scaled", n): a compile call that another process can repeat."""
    def build():
        fake = [cute.runtime.make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=16) for _ in range(2)]
        return cute.compile(_scale_launch, *fake, Int32(0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                            options="--enable-tvm-ffi", no_jit_engine=True)
    return FAMILY.compiled(("scaled", n), build)
'''

# compiling ahead: a dry run records the calls, then `mode` compiles them
_AHEAD = '''
import json, os, sys, time, warnings
from csrc_cute import jit
import jitprobe.kern as kern

mode, ns = sys.argv[1], (128, 256, 512)
with jit.dry_run() as calls:
    stand_ins = [kern.scaled(n) is jit._no_launch for n in ns] + [kern.compiled([]) is jit._no_launch]
t = time.perf_counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if mode == "child-first":  # a child alone builds the first kernel, then fails on a call of nothing
        missing = jit.CompileCall("jitprobe.kern", "missing", (1,))
        jit._finish_child(jit._start_child([calls[0], missing], 0), time.monotonic() + 300)
    jit.compile_ahead(calls, workers=2 if mode == "child-first" else int(mode))
seconds = time.perf_counter() - t
with jit.dry_run() as again:
    for n in ns:
        kern.scaled(n)
print(json.dumps(dict(calls=[[c.module, c.name, list(c.args)] for c in calls], stand_ins=stand_ins, again=len(again),
                      seconds=seconds, pid=os.getpid(), warnings=[str(w.message) for w in caught])))
'''

_CHILD = '''
import json, sys, time
from pathlib import Path
from csrc_cute import jit
import jitprobe.kern as kern

def run():
    builds = []
    t = time.perf_counter()
    fn = kern.compiled(builds)
    return {"builds": len(builds), "type": type(fn).__name__, "seconds": time.perf_counter() - t}

if sys.argv[1] == "short-lock-wait":
    jit.COMPILE_LOCK_TIMEOUT_S = 1.0
out = [run()]
if sys.argv[1] == "then-corrupt":  # break the entry, forget the loaded kernel, and ask again
    path = kern.FAMILY.entry(jit.compile_key("probe", ("scale", 128)))[0]
    for broken in (path.read_bytes()[: path.stat().st_size // 2], b"not an object"):
        path.write_bytes(broken)
        jit._MEMORY.clear()
        out.append(run())
print(json.dumps(out))
'''


def _write_probe(base, scale: float = 2.0):
    pkg = base / "jitprobe"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kern.py").write_text(_PROBE)
    (pkg / "helpers.py").write_text(f"SCALE = {scale}\n")


def _child_env(base, cache) -> dict:
    # keep the caller's path too: on the GPU machine CuTe DSL itself is found through PYTHONPATH
    path = [ROOT, str(base)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", PYTHONPATH=os.pathsep.join(path))
    env[jit.CACHE_DIR_ENV] = str(cache)
    return env


def _start(base, cache, mode="once", script=_CHILD):
    return subprocess.Popen([sys.executable, "-c", script, mode], env=_child_env(base, cache), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc) -> list[dict]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _entries(cache) -> list:
    """The files of the probe family's cache dir but the compile locks."""
    d = cache / "probe"
    return sorted(p for p in d.iterdir() if p.suffix != ".lock") if d.exists() else []


def _probe_entry(monkeypatch, base, cache):
    """(path, symbol) of the probe kernel's disk entry, computed here (the family hashes its sources)."""
    monkeypatch.syspath_prepend(str(base))
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(cache))
    return jit.KernelFamily("probe", ("jitprobe.kern",)).entry(("probe", "scale", 128, "sm_90a"))


def _is_sealed_object(path) -> bool:
    sections = jit._sections(path.read_bytes())
    return sections is not None and not any(n == b".text" and f & jit._SHF_WRITE for _, n, f in sections)


# ------------------------------------------------------------------------------------------------
# keys and the in-memory cache
# ------------------------------------------------------------------------------------------------
def test_compile_key_holds_the_arch(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    k90 = jit.compile_key("plan", ("count", 4, torch.int32))
    assert k90 == ("plan", "count", 4, torch.int32, "sm_90a")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert jit.compile_key("plan", ("count", 4, torch.int32)) != k90
    if not torch.cuda.is_available():
        monkeypatch.delenv("CUTE_DSL_ARCH")
        with pytest.raises(RuntimeError, match="CUTE_DSL_ARCH"):
            jit.target_arch()


def test_compile_key_rejects_values_without_a_stable_repr(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    with pytest.raises(TypeError, match="'plan'.*object"):
        jit.compile_key("plan", (1, (2, object())))
    with pytest.raises(TypeError, match="must be a tuple"):
        jit.compile_key("plan", [1, 2])
    with pytest.raises(ValueError, match="identifier"):
        jit.KernelFamily("no-dash", ("csrc_cute.status",))


def test_memory_cache_builds_once_per_key(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv(jit.CACHE_DIR_ENV, "off")
    family = jit.KernelFamily("memory_probe", ("csrc_cute.status",))
    built = []

    def build():
        built.append(object())
        return built[-1]

    first = family.compiled(("a", 1), build)
    assert family.compiled(("a", 1), build) is first and len(built) == 1
    assert family.compiled(("a", 2), build) is not first and len(built) == 2
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")  # another arch is another kernel
    family.compiled(("a", 1), build)
    assert len(built) == 3


# ------------------------------------------------------------------------------------------------
# where the disk cache lives, and what selects an entry
# ------------------------------------------------------------------------------------------------
def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(jit.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit.cache_root() == tmp_path / "xdg" / "moonep_ops" / "cute"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert jit.cache_root() == tmp_path / "home" / ".cache" / "moonep_ops" / "cute"
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert jit.cache_root() == tmp_path / "mine"
    for off in ("0", "off", "OFF"):
        monkeypatch.setenv(jit.CACHE_DIR_ENV, off)
        assert jit.cache_root() is None
        assert jit.KernelFamily("plan", ("csrc_cute.plan",)).entry(("plan", "sm_90a")) is None


def test_entry_changes_with_sources_and_versions(monkeypatch, tmp_path):
    _write_probe(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(tmp_path / "cache"))
    key = ("probe", "scale", 128, "sm_90a")

    def entry():
        return jit.KernelFamily("probe", ("jitprobe.kern",)).entry(key)

    path, symbol = entry()
    assert path.parent == tmp_path / "cache" / "probe" and symbol.isidentifier()
    assert {p.name for p in jit.source_files(["jitprobe.kern"])} == {"kern.py", "helpers.py"}
    assert entry() == (path, symbol)  # deterministic
    assert jit.KernelFamily("probe", ("jitprobe.kern",)).entry(key[:-1] + ("sm_100a",))[0] != path
    (tmp_path / "jitprobe" / "helpers.py").write_text("SCALE = 3.0\n")  # an imported module's source
    assert entry()[0] != path
    (tmp_path / "jitprobe" / "helpers.py").write_text("SCALE = 2.0\n")
    assert entry()[0] == path
    monkeypatch.setattr(jit, "dsl_versions", lambda: "cutlass=4.5.0 tvm_ffi=0.1.15.post2 py=(3, 11)")
    assert entry()[0] != path


def test_kernel_modules_hash_what_they_import():
    names = {p.name for p in jit.source_files(["csrc_cute.combine"])}
    assert {"combine.py", "dispatch.py", "warp.py", "status.py", "jit.py"} <= names
    assert "weights.py" not in names and "group_gemm.py" not in names


# ------------------------------------------------------------------------------------------------
# a real kernel through the disk cache, across processes
# ------------------------------------------------------------------------------------------------
def test_disk_round_trip_and_corrupt_entries(tmp_path, monkeypatch):
    _write_probe(tmp_path)
    cache = tmp_path / "cache"
    log = tmp_path / "compiles.jsonl"
    monkeypatch.setenv(jit.COMPILE_LOG_ENV, str(log))  # the children inherit it
    (cold,) = _finish(_start(tmp_path, cache))
    assert cold["builds"] == 1, cold
    (entry,) = _entries(cache)
    assert entry.suffix == ".o" and _is_sealed_object(entry)

    warm, *after_corruption = _finish(_start(tmp_path, cache, "then-corrupt"))
    assert warm["builds"] == 0 and warm["type"] == "Function", warm  # a tvm_ffi.Function, not compiled
    assert warm["seconds"] < cold["seconds"], (warm, cold)
    print(f"compile {cold['seconds']:.3f} s, load {warm['seconds']:.4f} s")
    assert [r["builds"] for r in after_corruption] == [1, 1], after_corruption  # ignored, rebuilt
    assert _entries(cache) == [entry] and _is_sealed_object(entry)  # and rewritten
    # the compile log: one line per kernel a process compiled or loaded, from both children
    lines = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [(r["family"], r["event"]) for r in lines] == [("probe", "built"), ("probe", "loaded"),
                                                         ("probe", "built"), ("probe", "built")], lines
    assert len({r["pid"] for r in lines}) == 2 and all(r["key"] == repr(("probe", "scale", 128, "sm_90a"))
                                                       for r in lines)
    summary = jit.summarize_compile_log(str(log))
    assert summary.startswith("4 kernels,") and "3 built" in summary and "probe loaded" in summary, summary


def test_concurrent_compiles_build_once_and_leave_one_valid_entry(monkeypatch, tmp_path):
    """Three processes asking for the same kernel at once: one compiles it under the entry's lock, the
    others wait for that lock and load the entry."""
    _write_probe(tmp_path)
    cache = tmp_path / "cache"
    procs = [_start(tmp_path, cache) for _ in range(3)]
    results = [_finish(p)[0] for p in procs]
    assert sorted(r["builds"] for r in results) == [0, 0, 1], results
    (entry,) = _entries(cache)  # no temporary file left behind either
    assert _is_sealed_object(entry)
    path, symbol = _probe_entry(monkeypatch, tmp_path, cache)
    assert path == entry and jit._load(path, symbol) is not None  # it loads, here too


def test_a_lock_held_too_long_is_not_waited_for(monkeypatch, tmp_path):
    """Another process holding the entry's lock past COMPILE_LOCK_TIMEOUT_S (here 1 s): the child warns
    and compiles the kernel itself; the lock is not broken (its holder still has it)."""
    import fcntl

    _write_probe(tmp_path)
    cache = tmp_path / "cache"
    path, _ = _probe_entry(monkeypatch, tmp_path, cache)
    path.parent.mkdir(parents=True)
    with open(path.with_suffix(".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = _start(tmp_path, cache, "short-lock-wait")
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        (res,) = json.loads(out.strip().splitlines()[-1])
        assert res["builds"] == 1 and res["seconds"] >= 1.0, res
        assert "locked by another process for over 1 s; compiling it here too" in err, err[-2000:]
        with pytest.raises(BlockingIOError):  # still ours
            with open(path.with_suffix(".lock")) as other:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert _entries(cache) == [path]


# ------------------------------------------------------------------------------------------------
# compiling ahead: a dry run names the kernels, several processes compile them at once
# ------------------------------------------------------------------------------------------------
def _built(log) -> list[tuple[str, int]]:
    """(key, pid) of every kernel the compile log says a process built."""
    return sorted((r["key"], r["pid"]) for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "built")


def _scaled_key(n: int) -> str:
    return repr(("probe", "scaled", n, "sm_90a"))


def test_dry_run_records_the_missing_kernels_and_compile_ahead_builds_each_once(monkeypatch, tmp_path):
    """A dry run launches nothing: each request returns a stand-in; the marked calls of kernels not on disk
    are recorded, an unmarked one is compiled at once. A child on its own builds the first recorded kernel
    (its pid in the log) and is reported by a warning with its output when a later call of its list fails;
    compile_ahead (this process and a child) then builds the other two, each once, into the disk cache,
    and a second dry run finds them all there."""
    _write_probe(tmp_path)
    cache, log = tmp_path / "cache", tmp_path / "compiles.jsonl"
    monkeypatch.setenv(jit.COMPILE_LOG_ENV, str(log))
    res = _finish(_start(tmp_path, cache, "child-first", script=_AHEAD))
    assert res["stand_ins"] == [True] * 4, res
    assert res["calls"] == [["jitprobe.kern", "scaled", [n]] for n in (128, 256, 512)], res
    assert res["again"] == 0, res  # all on disk now
    built = _built(log)
    assert [k for k, _ in built] == sorted([repr(("probe", "scale", 128, "sm_90a"))] +
                                           [_scaled_key(n) for n in (128, 256, 512)]), built
    assert len(_entries(cache)) == 4
    assert [pid for k, pid in built if k == _scaled_key(128)] != [res["pid"]], built
    (failed,) = res["warnings"]
    assert "compile-ahead process failed (exit 1)" in failed and "'missing'" in failed, failed


def test_compile_ahead_skips_a_kernel_another_process_is_compiling(monkeypatch, tmp_path):
    """With the lock of one entry held elsewhere, compile_ahead builds the others and leaves that one to its
    holder at once (no wait for the lock)."""
    import fcntl

    _write_probe(tmp_path)
    cache, log = tmp_path / "cache", tmp_path / "compiles.jsonl"
    monkeypatch.setenv(jit.COMPILE_LOG_ENV, str(log))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(cache))
    held, _ = jit.KernelFamily("probe", ("jitprobe.kern",)).entry(("probe", "scaled", 256, "sm_90a"))
    held.parent.mkdir(parents=True)
    with open(held.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        res = _finish(_start(tmp_path, cache, "1", script=_AHEAD))
    assert [k for k, _ in _built(log)] == sorted([repr(("probe", "scale", 128, "sm_90a")), _scaled_key(128),
                                                  _scaled_key(512)]), _built(log)
    assert not held.exists() and res["again"] == 1, res  # still missing: its holder never wrote it
    assert res["seconds"] < jit.COMPILE_LOCK_TIMEOUT_S / 10, res


def test_compiler_marks_module_level_functions_only():
    def local(n):
        return n

    with pytest.raises(TypeError, match="module-level"):
        jit.compiler(local)
    with jit.dry_run():
        assert jit.dry_running()
        seen = []  # another thread (autograd runs a backward on its own) is in the dry run too
        thread = threading.Thread(target=lambda: seen.append(jit.dry_running()))
        thread.start()
        thread.join()
        assert seen == [True]
        with pytest.raises(RuntimeError, match="already in a dry run"):
            with jit.dry_run():
                pass
    assert not jit.dry_running()


def test_moe_experts_compiles_ahead_once_per_kind_and_a_failure_only_warns(monkeypatch, tmp_path):
    """moe_experts' hook on a CUDA group (its checks only; the GPU tests run the real thing): precompile
    once per (group, training or not, ids dtype); skipped inside a dry run and with the disk cache off; a
    precompile that fails becomes a warning naming the error, and is not retried (the step's kernels then
    compile as their ops first run)."""
    from types import SimpleNamespace

    from moonep_ops import functional

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no CUDA
    monkeypatch.setenv(jit.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(functional, "_PRECOMPILED", set())
    asked = []

    def precompile(ep, experts, train, ids_dtype):
        asked.append((ep.key, train, ids_dtype))
        if ids_dtype == torch.int32:
            raise RuntimeError("a nested autograd.grad is refused here")
        functional._PRECOMPILED.add((ep.key, train, ids_dtype))

    monkeypatch.setattr(functional, "precompile", precompile)
    weight = torch.nn.Parameter(torch.zeros(1))
    experts = SimpleNamespace(parameters=lambda: [weight])
    ep, other = (SimpleNamespace(device=torch.device("cuda"), key=k) for k in ("g/0", "g/1"))
    x, w, ids = torch.zeros(2, 4), torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.int64)
    for _ in range(2):
        functional._precompile_once(ep, experts, x, ids, w)
    with torch.no_grad():
        functional._precompile_once(ep, experts, x, ids, w)
    assert asked == [("g/0", True, torch.int64), ("g/0", False, torch.int64)]
    with pytest.warns(UserWarning, match="compiling the step's kernels ahead failed .*nested autograd.grad"):
        functional._precompile_once(ep, experts, x, ids.int(), w)
    functional._precompile_once(ep, experts, x, ids.int(), w)
    assert asked[2:] == [("g/0", True, torch.int32)]
    with jit.dry_run():
        functional._precompile_once(other, experts, x, ids, w)
    monkeypatch.setenv(jit.CACHE_DIR_ENV, "off")
    functional._precompile_once(other, experts, x, ids, w)
    functional._precompile_once(SimpleNamespace(device=torch.device("cpu"), key="g/2"), experts, x, ids, w)
    assert len(asked) == 3, asked
