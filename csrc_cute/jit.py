"""One compile cache for every CuTe DSL kernel family: in memory, and persistent on disk.

A kernel family (``KernelFamily("plan", ("csrc_cute.plan",))``) names the modules that define its
kernels. ``family.compiled(static, build)`` returns the compiled function for the static values
``static`` (shapes, dtypes, flags) and the target arch: built once per process under one lock
(``cute.compile`` is not thread-safe), and kept on disk so that the next process loads it instead of
compiling.

Why an object file (CuTe DSL 4.4.2): ``cute.compile`` always compiles (it passes ``no_cache=True``;
``CUTE_DSL_CACHE_DIR`` only serves implicit ``@cute.jit`` calls, and even then keeps IR that must be
traced and JIT-linked again). A function compiled with ``--enable-tvm-ffi`` exports its host code
and embedded cubin to an ELF object (``export_to_c``), and ``cute.runtime.load_module(path,
enable_tvm_ffi=True)[name]`` loads it back as a ``tvm_ffi.Function`` in milliseconds, with no
tracing, MLIR or ptxas. Functions compiled without tvm-ffi are cached in memory only.

Disk layout: ``<root>/<family>/<sha256>.o``, the hash over the compile key (family, static values,
arch) and the family's fingerprint (its sources, the DSL/tvm-ffi/Python versions, this format's
version), so a change to any of them selects a new entry. ``root`` is ``$MOONEP_CUTE_CACHE_DIR``
(``0``/``off`` disables the disk cache), else ``$XDG_CACHE_HOME/moonep_ops/cute``, else
``~/.cache/moonep_ops/cute``. Entries are written to a temporary file and renamed into place, so
ranks compiling the same kernel at once each leave a complete file and the last rename wins; an
entry that is not a well-formed object or does not load is ignored and rewritten. A process compiling
an entry holds an exclusive ``flock`` on ``<sha256>.lock`` beside it, so the other processes that need
the same kernel at the same time (the ranks of one job, parallel test workers) wait and load the entry
instead of compiling it again; the lock dies with its holder, and one held past
``COMPILE_LOCK_TIMEOUT_S`` (a stuck compile, a filesystem without locks) is not waited for.

Compiling ahead: a fresh process's first MoE step needs ~15 kernels that take 2-12 s each to compile
(~33 s one after another on an H200). ``dry_run()`` runs a step's host code with every launch replaced
by nothing and records the kernels it would compile (each as the call of a ``@compiler`` function: a
module-level function of static values, so another process can repeat it); ``compile_ahead(calls)``
then compiles them side by side in this process and child processes, which write the disk cache, and
the real step loads them. The workers share one list and take its entries in turn: an entry another
process holds the lock of is skipped, not waited for, so no kernel is compiled twice.

``$MOONEP_CUTE_COMPILE_LOG`` (a file path) appends one JSON line per kernel this process compiled or
loaded from disk: family, key, ``built``/``loaded``, seconds (lock wait included), pid, and the pytest
test that asked for it. ``python -m csrc_cute.jit LOG`` sums it per family, per test and per key.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import contextvars
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

CACHE_DIR_ENV = "MOONEP_CUTE_CACHE_DIR"
COMPILE_LOG_ENV = "MOONEP_CUTE_COMPILE_LOG"
COMPILE_WORKERS_ENV = "MOONEP_COMPILE_WORKERS"
_DISABLED = ("0", "off")
# Bump when the entry layout or the way entries are exported/loaded changes.
_FORMAT = 1
# Static values must print the same in every process: their repr is hashed into the disk key.
_STATIC_TYPES = (bool, int, float, str, type(None), torch.dtype)

# How long a process waits for another one compiling the same entry (a big GEMM compiles in ~10-60 s).
COMPILE_LOCK_TIMEOUT_S = 600.0

_MEMORY: dict[tuple, Any] = {}
_LOCK = threading.Lock()
_WARNED: set[str] = set()


# ------------------------------------------------------------------------------------------------
# compile key
# ------------------------------------------------------------------------------------------------
def target_arch() -> str:
    """The arch the DSL compiles for: ``CUTE_DSL_ARCH`` when set (the DSL obeys it over the device),
    else the CUDA device's."""
    return os.environ.get("CUTE_DSL_ARCH") or _device_arch()


@functools.lru_cache(maxsize=None)
def _device_arch() -> str:
    """Device 0's arch, named as the DSL names it when it detects the GPU (``sm_90a`` for Hopper: "a" from
    9.0 on); the DSL reads device 0 too, whichever device is current."""
    if not torch.cuda.is_available():
        raise RuntimeError("csrc_cute.jit: no CUDA device and CUTE_DSL_ARCH is not set: "
                           "set CUTE_DSL_ARCH (e.g. sm_90a) to compile without a GPU")
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def _check_static(family: str, value) -> None:
    if isinstance(value, tuple):
        for v in value:
            _check_static(family, v)
    elif not isinstance(value, _STATIC_TYPES):
        raise TypeError(f"csrc_cute.jit: compile key of {family!r} holds {value!r} of type "
                        f"{type(value).__name__}; static values must be bool/int/float/str/None/"
                        "torch.dtype or tuples of them (their repr is the persistent key)")


def compile_key(family: str, static: tuple) -> tuple:
    """(family, *static values, target arch): everything a compiled kernel depends on, but its sources."""
    if not isinstance(static, tuple):
        raise TypeError(f"csrc_cute.jit: static values of {family!r} must be a tuple, got {type(static).__name__}")
    _check_static(family, static)
    return (family, *static, target_arch())


# ------------------------------------------------------------------------------------------------
# fingerprint: sources and versions
# ------------------------------------------------------------------------------------------------
def _module_files(name: str) -> list[Path]:
    """The .py files of module `name` (every file under it if it is a package)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"csrc_cute.jit: kernel source module {name!r} not found")
    if spec.submodule_search_locations:
        return sorted(p for d in spec.submodule_search_locations for p in Path(d).rglob("*.py"))
    return [Path(spec.origin)]


def _file_of(root: Path, scope: str, module: str) -> Path | None:
    """The file of `module` (under package `scope`, whose directory is `root`), found without importing."""
    rel = Path(*module.split(".")[1:]) if module != scope else Path()
    for cand in (root / rel / "__init__.py", (root / rel).with_suffix(".py") if module != scope else None):
        if cand is not None and cand.is_file():
            return cand
    return None


def _imports(path: Path, module: str) -> frozenset[str]:
    """Absolute names of what the file of `module` imports (top level or inside functions); for
    ``from pkg import name`` both ``pkg`` and ``pkg.name`` (name may be a submodule)."""
    st = path.stat()
    return _parsed_imports(path, module, st.st_mtime_ns, st.st_size)


# every kernel family walks its import closure once per process, and the families share most files
# (warp, status, checks, ...): each file is parsed once while it is unchanged (~0.2 s of a warm start)
@functools.lru_cache(maxsize=None)
def _parsed_imports(path: Path, module: str, mtime_ns: int, size: int) -> frozenset[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(p for p in (base, node.module) if p)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return frozenset(found)


def source_files(modules: Sequence[str]) -> list[Path]:
    """The files of `modules` and of every module of their top-level package that they import,
    transitively."""
    files: set[Path] = set()
    for module in modules:
        scope = module.partition(".")[0]
        root = Path(importlib.util.find_spec(scope).origin).parent.resolve()
        todo = [f.resolve() for f in _module_files(module)]
        while todo:
            path = todo.pop()
            if path in files:
                continue
            files.add(path)
            rel = path.relative_to(root).with_suffix("").parts
            name = ".".join((scope, *(rel[:-1] if rel[-1] == "__init__" else rel)))
            for imported in _imports(path, name):
                if imported == scope or imported.startswith(scope + "."):
                    f = _file_of(root, scope, imported)
                    if f is not None:
                        todo.append(f.resolve())
    return sorted(files)


def dsl_versions() -> str:
    """Versions the exported objects depend on: the CuTe DSL, tvm-ffi, Python."""
    import cutlass
    import tvm_ffi

    return f"cutlass={cutlass.__version__} tvm_ffi={tvm_ffi.__version__} py={sys.version_info[:2]}"


def fingerprint(modules: Sequence[str]) -> str:
    """Hash of the kernel sources (path and bytes of each file), the versions and the entry format."""
    h = hashlib.sha256(f"format={_FORMAT} {dsl_versions()}".encode())
    for f in source_files(modules):
        data = f.read_bytes()
        h.update(f"\n{f.name} {len(data)}\n".encode())
        h.update(data)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------
# disk cache
# ------------------------------------------------------------------------------------------------
def cache_root() -> Path | None:
    """Root of the disk cache, or None when ``$MOONEP_CUTE_CACHE_DIR`` is ``0``/``off``."""
    value = os.environ.get(CACHE_DIR_ENV, "")
    if value.strip().lower() in _DISABLED:
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moonep_ops" / "cute"


_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SHF_WRITE, _SHF_ALLOC, _SHF_EXECINSTR = 0x1, 0x2, 0x4


def _sections(data: bytes) -> list[tuple[int, bytes, int]] | None:
    """(header offset, name, flags) of every section of an ELF64 little-endian object; None if `data` is
    not one or its section table is cut off (a partial or corrupt entry)."""
    if len(data) < _ELF_HEADER.size or data[:6] != b"\x7fELF\x02\x01":
        return None
    head = _ELF_HEADER.unpack_from(data)
    shoff, shentsize, shnum, shstrndx = head[6], head[11], head[12], head[13]
    if shentsize != _SECTION.size or shstrndx >= shnum or shoff + shnum * shentsize > len(data):
        return None
    table = [_SECTION.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    names_at, names_size = table[shstrndx][4], table[shstrndx][5]
    if names_at + names_size > len(data):
        return None
    out = []
    for i, sec in enumerate(table):
        if sec[1] != 8 and sec[4] + sec[5] > len(data):  # 8: SHT_NOBITS occupies no file bytes
            return None
        end = data.find(b"\0", names_at + sec[0], names_at + names_size)
        if end < 0:
            return None
        out.append((shoff + i * shentsize, data[names_at + sec[0]:end], sec[2]))
    return out


def _seal_text_sections(data: bytes) -> bytes:
    """The exported object holds a second ``.text`` section that is writable (a table of function
    pointers); LLVM's in-process loaders merge same-named sections and then protect them wrongly, a
    reported source of random segfaults in multi-process runs (NVIDIA/cutlass#3162). The table is only
    written by relocation at load time, so it is made read+execute like the code section."""
    out = bytearray(data)
    for at, name, flags in _sections(data) or ():
        if name == b".text" and flags & _SHF_WRITE:
            struct.pack_into("<Q", out, at + 8, (flags & ~_SHF_WRITE) | _SHF_ALLOC | _SHF_EXECINSTR)
    return bytes(out)


def _warn_once(what: str, exc: BaseException) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"csrc_cute.jit: {what} ({type(exc).__name__}: {exc}); compiling in memory only",
                      stacklevel=3)


def _load(path: Path, symbol: str):
    """The function stored at `path`, or None if there is no well-formed, loadable entry."""
    try:
        data = path.read_bytes()
    except OSError:  # missing (the usual miss) or unreadable
        return None
    if _sections(data) is None:
        return None
    import cutlass.cute as cute

    try:
        return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[symbol]
    except Exception:  # noqa: BLE001 - any failure to load means: compile and rewrite the entry
        return None


def _store(path: Path, symbol: str, fn) -> None:
    """Export `fn` to `path`: into a temporary file of the same directory, then an atomic rename."""
    from cutlass.cutlass_dsl.tvm_ffi_provider import TVMFFIJitCompiledFunctionBase

    if not isinstance(fn, TVMFFIJitCompiledFunctionBase):
        return  # only tvm-ffi functions can be exported and loaded back
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.{uuid.uuid4().hex[:8]}.", suffix=".o", dir=path.parent)
        os.close(fd)
        try:
            fn.export_to_c(tmp, function_name=symbol)  # the ".o" suffix selects the object format
            data = _seal_text_sections(Path(tmp).read_bytes())
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception as exc:  # noqa: BLE001 - the compiled function is still good: run without the disk
        _warn_once(f"cannot write the kernel cache under {path.parent}", exc)


@contextlib.contextmanager
def _entry_lock(path: Path, wait: bool = True):
    """Hold an exclusive flock on `path`'s lock file (waiting at most COMPILE_LOCK_TIMEOUT_S for another
    process's); without one (no lock file, no flock, the wait ran out) the body runs unlocked. Yields
    True, or False when `wait` is False and another process holds the lock (the body must then leave
    the entry to it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        _warn_once(f"cannot create a compile lock under {path.parent}", exc)
        yield True
        return
    try:
        deadline = time.monotonic() + COMPILE_LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not wait:
                    yield False
                    return
                if time.monotonic() > deadline:
                    warnings.warn(f"csrc_cute.jit: {path.name} has been locked by another process for over "
                                  f"{COMPILE_LOCK_TIMEOUT_S:.0f} s; compiling it here too", stacklevel=4)
                    break
                time.sleep(0.05)
            except OSError:  # this filesystem has no flock: compile as if unlocked
                break
        yield True
    finally:
        os.close(fd)  # drops the lock


def _log_compile(family: str, key: tuple, event: str, seconds: float) -> None:
    """One line of $MOONEP_CUTE_COMPILE_LOG (if set); a line of one write() so processes can share a file."""
    path = os.environ.get(COMPILE_LOG_ENV)
    if not path:
        return
    line = json.dumps(dict(family=family, key=repr(key), event=event, seconds=round(seconds, 4), pid=os.getpid(),
                           test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]))
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError as exc:
        _warn_once(f"cannot append to the compile log {path}", exc)


def summarize_compile_log(path: str, top: int = 15) -> str:
    """The log's seconds and counts per (family, event), per test and per key (largest first)."""
    rows = [json.loads(ln) for ln in open(path) if ln.strip()]
    out = [f"{len(rows)} kernels, {sum(r['seconds'] for r in rows):.1f} s, "
           f"{sum(r['event'] == 'built' for r in rows)} built"]
    for what, field in (("family/event", lambda r: f"{r['family']} {r['event']}"), ("test", lambda r: r["test"]),
                        ("key (built)", lambda r: f"{r['family']} {r['key']}" if r["event"] == "built" else None)):
        seconds, count = collections.Counter(), collections.Counter()
        for r in rows:
            name = field(r)
            if name is not None:
                seconds[name] += r["seconds"]
                count[name] += 1
        out.append(f"per {what}:")
        out += [f"  {t:8.1f} s {count[n]:4d}x  {n or '(not in a test)'}" for n, t in seconds.most_common(top)]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# the cache
# ------------------------------------------------------------------------------------------------
def forget_compiled() -> None:
    """Drop every kernel this process holds in memory, so that the next request of each compiles (or loads)
    it again: the compile checks' child (csrc_cute/compile_check.py) serves many requests, and each must
    write the PTX of every kernel it asks for."""
    with _LOCK:
        _MEMORY.clear()


class KernelFamily:
    """The kernels of `modules` (module or package names; what they import from their top-level
    package counts as their source too), cached under the name `name`."""

    def __init__(self, name: str, modules: Sequence[str]):
        if not name.isidentifier():
            raise ValueError(f"csrc_cute.jit: family name must be an identifier, got {name!r}")
        self.name = name
        self.modules = tuple(modules)

    @functools.cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.modules)

    def entry(self, key: tuple) -> tuple[Path, str] | None:
        """(file, exported symbol) of `key`'s disk entry, or None when the disk cache is off."""
        root = cache_root()
        if root is None:
            return None
        digest = hashlib.sha256(f"{self.fingerprint}\n{key!r}".encode()).hexdigest()
        return root / self.name / f"{digest}.o", f"moonep_{self.name}_{digest[:16]}"

    def compiled(self, static: tuple, build: Callable[[], Any]):
        """The compiled function for `static` (and the target arch): from memory, else from the disk
        cache, else ``build()`` (one ``cute.compile``), then kept in both. In a dry run: a stand-in that
        launches nothing, with the kernel recorded if it must still be compiled."""
        fn = _MEMORY.get((self.name, *static, target_arch()))  # the hot path: a kernel launch's lookup
        if fn is not None:
            return fn if _DRY_RUN is None else _no_launch
        key = compile_key(self.name, static)
        if _DRY_RUN is not None:
            return self._record(key, build, _DRY_RUN)
        return self._get(key, build, wait=not getattr(_AHEAD, "on", False))

    def _get(self, key: tuple, build: Callable[[], Any], wait: bool = True):
        """From memory, else from disk, else built (and stored); None if not `wait` and another process
        holds the entry's lock (compiling it now)."""
        with _LOCK:
            fn = _MEMORY.get(key)
            if fn is not None:
                return fn
            t0 = time.perf_counter()
            entry = self.entry(key)
            event = "built"
            if entry is None:
                fn = build()
            else:
                with _entry_lock(entry[0], wait) as ours:  # another process compiling it: wait, then load
                    if not ours:
                        return None
                    fn = _load(*entry)
                    if fn is None:
                        fn = build()
                        _store(*entry, fn)
                    else:
                        event = "loaded"
            _log_compile(self.name, key, event, time.perf_counter() - t0)
            _MEMORY[key] = fn
            return fn

    def _record(self, key: tuple, build: Callable[[], Any], calls: list[CompileCall]):
        """A dry run's request: nothing to do for a kernel on disk; else the `@compiler` call that compiles
        it joins `calls`, or (no disk cache to hand it over, or no such call) it is compiled here now."""
        entry = self.entry(key)
        call = _CALL.get()
        if entry is not None and entry[0].is_file():
            pass  # the step loads it
        elif entry is None or call is None:
            self._get(key, build)
        elif call not in calls:
            calls.append(call)
        return _no_launch


# ------------------------------------------------------------------------------------------------
# compiling ahead
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompileCall:
    """One call of a `@compiler` function (module, qualified name, static arguments): repeatable in any
    process, where it compiles (or loads) its kernel."""

    module: str
    name: str
    args: tuple
    kwargs: tuple = ()  # (name, value) pairs, sorted

    def __call__(self):
        return getattr(importlib.import_module(self.module), self.name)(*self.args, **dict(self.kwargs))


_CALL: contextvars.ContextVar[CompileCall | None] = contextvars.ContextVar("moonep_compile_call", default=None)
# The calls a dry run records, None outside one. For the whole process, not one thread: a backward runs
# on autograd's device threads, and a launch there during a dry run must launch nothing either.
_DRY_RUN: list[CompileCall] | None = None
_AHEAD = threading.local()  # .on: this thread is compiling ahead (skips the kernels others compile)


def compiler(fn: Callable) -> Callable:
    """Mark `fn`, a module-level function of static values (hashable, picklable) that compiles its
    kernel through ``KernelFamily.compiled``: a dry run can then hand the call to another process."""
    if "<locals>" in fn.__qualname__:
        raise TypeError(f"csrc_cute.jit.compiler: {fn.__qualname__} must be a module-level function")

    @functools.wraps(fn)
    def call(*args, **kwargs):
        token = _CALL.set(CompileCall(fn.__module__, fn.__qualname__, args, tuple(sorted(kwargs.items()))))
        try:
            return fn(*args, **kwargs)
        finally:
            _CALL.reset(token)
    return call


def _no_launch(*args, **kwargs) -> None:
    """What a dry run launches in place of a kernel."""


def dry_running() -> bool:
    return _DRY_RUN is not None


@contextlib.contextmanager
def dry_run():
    """Run host code with every kernel launch of the process (all threads: autograd runs a backward on its
    own) replaced by nothing; yields the list of the `CompileCall`s of the kernels it asked for that are
    neither in memory nor on disk (filled as it runs). The code's results are garbage (no kernel wrote
    them): only its requests count, so it must not read device values on the host, and no other thread
    should be running kernels meanwhile (a first step's set-up: moonep_ops/functional.py, `precompile`)."""
    global _DRY_RUN
    with _LOCK:
        if _DRY_RUN is not None:
            raise RuntimeError("csrc_cute.jit.dry_run: already in a dry run")
        _DRY_RUN = calls = []
    try:
        yield calls
    finally:
        _DRY_RUN = None


def compile_workers() -> int:
    """Processes that compile ahead at once: ``$MOONEP_COMPILE_WORKERS``, else this process's share of the
    cores (the ``$LOCAL_WORLD_SIZE`` ranks of a torchrun job share a machine), at most 16."""
    value = os.environ.get(COMPILE_WORKERS_ENV, "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{COMPILE_WORKERS_ENV} must be an integer >= 1, got {value!r}")
        return int(value)
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(16, (os.cpu_count() or 1) // ranks))


def compile_ahead(calls: Sequence[CompileCall], workers: int | None = None) -> None:
    """Compile the kernels of `calls` (a dry run's record) side by side: this process and up to
    ``workers - 1`` child processes (default `compile_workers()`) go through the one list from different
    starts, each compiling the entries no other process holds, into the disk cache. A child that fails
    is reported (a warning with its output); what it left undone is compiled on demand."""
    calls = list(dict.fromkeys(calls))
    if not calls:
        return
    workers = min(len(calls), compile_workers() if workers is None else workers)
    if cache_root() is None:
        workers = 1  # a child could not hand its kernels back
    children = [_start_child(calls, i * len(calls) // workers) for i in range(1, workers)]
    deadline = time.monotonic() + COMPILE_LOCK_TIMEOUT_S  # for all of them: a stuck child is killed by then
    try:
        _compile_from(calls, 0)
    finally:
        for child in children:
            _finish_child(child, deadline)


def _compile_from(calls: list[CompileCall], start: int) -> None:
    """Run `calls` from index `start` round, skipping each kernel another process is compiling."""
    _AHEAD.on = True
    try:
        for call in calls[start:] + calls[:start]:
            call()
    finally:
        _AHEAD.on = False


# a compile-ahead child: this process's import path first, then its share of the list
_CHILD = ("import pickle, sys; sys.path[:0] = pickle.load(sys.stdin.buffer); "
          "from csrc_cute.jit import _compile_from; _compile_from(*pickle.load(sys.stdin.buffer))")


def _child_device() -> str | None:
    """CUDA_VISIBLE_DEVICES naming this process's current GPU for a child (None: CUDA not in use here)."""
    if not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return str(index)
    return visible[index] if index < len(visible) else None


def _start_child(calls: list[CompileCall], start: int):
    out = tempfile.TemporaryFile()
    env = dict(os.environ, CUTE_DSL_ARCH=target_arch(), OMP_NUM_THREADS="1")
    env[CACHE_DIR_ENV] = str(cache_root())
    device = _child_device()
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=out,
                            stderr=subprocess.STDOUT, env=env)
    path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    try:
        proc.stdin.write(pickle.dumps(path) + pickle.dumps((calls, start)))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died first: _finish_child reports it
    return proc, out


def _finish_child(child, deadline: float) -> None:
    proc, out = child
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.returncode != 0:
        out.seek(0)
        tail = out.read()[-3000:].decode(errors="replace")
        warnings.warn(f"csrc_cute.jit: a compile-ahead process failed (exit {proc.returncode}); the kernels "
                      f"it left are compiled on demand. Its output:\n{tail}", stacklevel=3)
    out.close()


__all__ = ["CACHE_DIR_ENV", "COMPILE_LOG_ENV", "COMPILE_WORKERS_ENV", "CompileCall", "KernelFamily", "cache_root",
           "compile_ahead", "compile_key", "compile_workers", "compiler", "dry_run", "dry_running", "dsl_versions",
           "fingerprint", "forget_compiled", "source_files", "summarize_compile_log", "target_arch"]


if __name__ == "__main__":
    print(summarize_compile_log(sys.argv[1]))
