"""Compile CuTe DSL kernels for a GPU arch on a machine without a GPU, and report on the result.

Shared by every kernel in ``csrc_cute``: CI compiles each kernel for ``sm_90a`` on CPU-only machines.

How it works (CuTe DSL 4.4.2): with ``CUTE_DSL_ARCH=<arch>``, ``CUTE_DSL_KEEP_PTX=1``,
``CUTE_DSL_KEEP_CUBIN=1`` and ``CUTE_DSL_DUMP_DIR=<dir>`` in the environment, ``cute.compile`` writes
``<dir>/<function>.<arch>.ptx`` and ``.cubin`` and only then tries to load the cubin, which fails with a
``DSLRuntimeError`` caused by ``CudaDriverDependencyError`` when there is no libcuda. The DSL reads those
variables once, when it is first used in a process, so the compile runs in a child process started
with them (``run_compile_check``); inside that child, ``expect_no_driver`` turns exactly that failure into
a normal return and lets every other error through. ``ptxas -arch=<arch> -v`` on the PTX then reports
registers, shared memory, stack frame and spills per kernel.

One child per arch serves every compile request of its parent process, one after another (importing
torch and the DSL costs ~2 s of CPU per process, a small kernel's compile less): before each request it
empties its dump directory and forgets the kernels compiled in memory (``jit.forget_compiled``), so each
request compiles and writes exactly what a fresh process would; after it, the artifacts are moved to the
request's ``dump_dir``. A request that fails or times out ends the child; the next one starts a new one.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import glob
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

DEFAULT_ARCH = "sm_90a"


def artifact_env(dump_dir: str, arch: str = DEFAULT_ARCH) -> dict[str, str]:
    """Environment variables that make the DSL target ``arch`` and keep PTX/cubin in ``dump_dir``, with
    the kernel disk cache (csrc_cute/jit.py) off: a kernel loaded from it would write no PTX."""
    from csrc_cute.jit import CACHE_DIR_ENV

    return {
        "CUTE_DSL_ARCH": arch,
        "CUTE_DSL_KEEP_PTX": "1",
        "CUTE_DSL_KEEP_CUBIN": "1",
        "CUTE_DSL_DUMP_DIR": os.path.abspath(dump_dir),
        CACHE_DIR_ENV: "off",
    }


def _is_missing_driver(exc: BaseException) -> bool:
    """True if ``exc`` is a DSLRuntimeError whose cause chain holds CudaDriverDependencyError."""
    from cutlass.base_dsl.common import CudaDriverDependencyError, DSLRuntimeError

    if not isinstance(exc, DSLRuntimeError):
        return False
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, CudaDriverDependencyError):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


@contextlib.contextmanager
def expect_no_driver() -> Iterator[dict[str, bool]]:
    """Swallow exactly the "compiled, but no CUDA driver to load it" failure of ``cute.compile``.

    Yields a dict whose ``"driver_missing"`` entry says whether that failure happened.
    """
    state = {"driver_missing": False}
    try:
        yield state
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is exactly the expected failure
        if not _is_missing_driver(exc):
            raise
        state["driver_missing"] = True


def compile_and_report(what: str, build: Callable[[], Any]) -> None:
    """Run ``build`` (one ``cute.compile``) inside ``expect_no_driver`` and print how loading went.
    On a CPU machine only the first load in a process raises; later ones do not."""
    with expect_no_driver() as state:
        build()
    outcome = "load failed: no CUDA driver (expected on CPU)" if state["driver_missing"] else "no load error"
    print(f"compiled {what}: {outcome}", flush=True)


def find_artifacts(dump_dir: str, arch: str = DEFAULT_ARCH) -> dict[str, list[str]]:
    """The PTX and cubin files the DSL wrote into ``dump_dir`` for ``arch``."""
    return {
        "ptx": sorted(glob.glob(os.path.join(dump_dir, f"*.{arch}.ptx"))),
        "cubin": sorted(glob.glob(os.path.join(dump_dir, f"*.{arch}.cubin"))),
    }


@dataclasses.dataclass
class KernelStats:
    """What ``ptxas -v`` says about one kernel (``.entry``) of a PTX file."""

    name: str
    registers: int = 0
    shared_bytes: int = 0
    stack_frame_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    cmem_bytes: int = 0
    # ptxas' "wgmma.mma_async instructions are serialized" (C7510-C7516): each wgmma waits for the previous
    # one, the tensor cores idle between them (e.g. too few registers for the wgmma pipeline); its reason
    wgmma_serialized: str = ""

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


_RE_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_RE_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_CMEM = re.compile(r"(\d+) bytes cmem\[0\]")
_RE_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized (.*?) in the function '([^']+)'")


def parse_ptxas_verbose(text: str) -> list[KernelStats]:
    """Parse the ``-v`` output of ptxas into one ``KernelStats`` per entry function."""
    stats: list[KernelStats] = []
    cur: KernelStats | None = None
    for line in text.splitlines():
        m = _RE_FUNC.search(line)
        if m:
            cur = KernelStats(name=m.group(1))
            stats.append(cur)
            continue
        if cur is None:
            continue
        m = _RE_FRAME.search(line)
        if m:
            cur.stack_frame_bytes, cur.spill_store_bytes, cur.spill_load_bytes = map(int, m.groups())
        m = _RE_USED.search(line)
        if m:
            cur.registers = int(m.group(1))
            m2 = _RE_SMEM.search(line)
            if m2:
                cur.shared_bytes = int(m2.group(1))
            m3 = _RE_CMEM.search(line)
            if m3:
                cur.cmem_bytes = int(m3.group(1))
    for m in _RE_SERIALIZED.finditer(text):  # the function's name: ptxas may say it before or after its stats
        for s in stats:
            if s.name == m.group(2):
                s.wgmma_serialized = m.group(1)
    return stats


def find_ptxas() -> str | None:
    """Path of a ``ptxas`` binary (``$PTXAS``, ``PATH``, ``$CUDA_HOME/bin``), or None."""
    cands = [os.environ.get("PTXAS"), shutil.which("ptxas")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands.append(os.path.join(home, "bin", "ptxas"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def ptxas_report(ptx_path: str, arch: str = DEFAULT_ARCH, ptxas: str | None = None) -> list[KernelStats]:
    """Assemble ``ptx_path`` with ``ptxas -arch=<arch> -v`` and return per-kernel statistics."""
    exe = ptxas or find_ptxas()
    if exe is None:
        raise FileNotFoundError("ptxas not found (set $PTXAS or put it on PATH)")
    # The DSL writes the PTX with a trailing NUL byte, which ptxas rejects: assemble a cleaned copy.
    with open(ptx_path, "rb") as f:
        data = f.read().rstrip(b"\0")
    base = os.path.join(tempfile.mkdtemp(prefix="ptxas_"), "kernel")
    with open(base + ".ptx", "wb") as f:
        f.write(data)
    proc = subprocess.run(
        [exe, f"-arch={arch}", "-v", base + ".ptx", "-o", base + ".cubin"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx_path}:\n{proc.stderr}")
    return parse_ptxas_verbose(proc.stdout + proc.stderr)


@dataclasses.dataclass
class CompileCheckResult:
    ptx: list[str]
    cubin: list[str]
    stats: list[KernelStats]
    child_output: str

    def summary(self) -> str:
        lines = []
        for s in self.stats:
            lines.append(
                f"{s.name}: {s.registers} registers, {s.shared_bytes} B smem (static), "
                f"{s.stack_frame_bytes} B stack, {s.spill_store_bytes} B spill stores, "
                f"{s.spill_load_bytes} B spill loads"
                + (f", wgmma serialized {s.wgmma_serialized}" if s.wgmma_serialized else "")
            )
        return "\n".join(lines)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(reply_fd: int) -> None:
    """Child-process entry of ``_CompileChild`` (artifact environment set): one JSON request per line of
    stdin, ``{"target", "kwargs", "dump_dir", "env"}``; calls ``target(**kwargs)`` and answers on
    ``reply_fd`` with one JSON line, ``{"ok": true, "value": <its return value>}`` or ``{"ok": false,
    "error": <traceback>}``. What the call prints goes to this process's stdout/stderr (the parent's log)."""
    import importlib
    import traceback

    from csrc_cute.jit import forget_compiled

    scratch = os.environ["CUTE_DSL_DUMP_DIR"]
    with os.fdopen(reply_fd, "w") as reply:
        for line in sys.stdin:
            req = json.loads(line)
            for name in os.listdir(scratch):  # what an earlier request left (a failed one)
                os.remove(os.path.join(scratch, name))
            os.environ.update(req["env"])  # the test asking, for $MOONEP_CUTE_COMPILE_LOG
            forget_compiled()
            try:
                mod, _, fn = req["target"].partition(":")
                value = getattr(importlib.import_module(mod), fn)(**req["kwargs"])
                if req["dump_dir"] is not None:
                    for name in os.listdir(scratch):
                        shutil.move(os.path.join(scratch, name), os.path.join(req["dump_dir"], name))
                answer = json.dumps({"ok": True, "value": value})
            except BaseException:  # noqa: BLE001 - reported to the parent, which ends this process
                answer = json.dumps({"ok": False, "error": traceback.format_exc()})
            sys.stdout.flush()
            sys.stderr.flush()
            reply.write(answer + "\n")
            reply.flush()


class _CompileChild:
    """A child process with ``artifact_env(<its scratch dir>, arch)`` that runs ``_serve``; its stdout and
    stderr go to an append-only log file, of which each request returns the part written meanwhile."""

    def __init__(self, arch: str):
        self.arch = arch
        self.scratch = tempfile.mkdtemp(prefix=f"compile_check_{arch}_")
        self.log = tempfile.TemporaryFile(mode="ab+")  # O_APPEND: the child's writes land at the end
        env = dict(os.environ)
        env.update(artifact_env(self.scratch, arch))
        env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        reply_r, reply_w = os.pipe()
        code = f"from csrc_cute.compile_check import _serve\n_serve({reply_w})\n"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=_ROOT, stdin=subprocess.PIPE,
                                         stdout=self.log, stderr=subprocess.STDOUT, pass_fds=(reply_w,))
        finally:
            os.close(reply_w)
        self.reply_fd = reply_r

    def request(self, target: str, kwargs: dict, dump_dir: str | None, timeout: float) -> tuple[Any, str]:
        """(return value of ``target(**kwargs)`` in the child, what the child printed meanwhile); raises
        RuntimeError naming the target and arch, with that output, if it raised, died or timed out."""
        try:
            return self._request(target, kwargs, dump_dir, timeout)
        except BaseException:
            # also an interrupt while waiting (pytest-timeout, Ctrl-C): the child may still be working on
            # this request, and its late answer must not be taken for the next one's
            self.close(kill=True)
            raise

    def _request(self, target: str, kwargs: dict, dump_dir: str | None, timeout: float) -> tuple[Any, str]:
        start = os.fstat(self.log.fileno()).st_size
        env = {"PYTEST_CURRENT_TEST": os.environ.get("PYTEST_CURRENT_TEST", "")}
        line = json.dumps(dict(target=target, kwargs=kwargs, dump_dir=dump_dir, env=env)) + "\n"
        answer, failure = b"", ""
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except OSError as exc:  # the child is gone
            failure = f"the compile child is gone ({exc})"
        deadline = time.monotonic() + timeout
        while not failure and not answer.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.reply_fd], [], [], left)[0]:
                failure = f"timed out after {timeout:.0f} s"
                break
            chunk = os.read(self.reply_fd, 1 << 16)
            if not chunk:
                failure = f"the compile child exited (rc={self.proc.wait()})"
            answer += chunk
        if not failure:
            reply = json.loads(answer)
            failure = "" if reply["ok"] else reply["error"]
        output = self._output_since(start)
        if failure:
            raise RuntimeError(f"compile of {target} for {self.arch} failed: {failure}\noutput:\n{output}")
        return reply["value"], output

    def _output_since(self, start: int) -> str:
        end = os.fstat(self.log.fileno()).st_size
        return os.pread(self.log.fileno(), end - start, start).decode(errors="replace")

    def close(self, kill: bool = False) -> None:
        """End the child: at the end of its requests (closed stdin ends its loop), or with ``kill`` at once."""
        if _CHILDREN.get(self.arch) is self:
            del _CHILDREN[self.arch]
        if self.reply_fd < 0:
            return
        if kill:
            self.proc.kill()
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.reply_fd)
        self.reply_fd = -1
        self.log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


_CHILDREN: dict[str, _CompileChild] = {}
_CHILDREN_LOCK = threading.Lock()


@atexit.register
def _close_children() -> None:
    for child in list(_CHILDREN.values()):
        child.close()


def run_in_compile_child(target: str, kwargs: dict[str, Any] | None = None, dump_dir: str | None = None,
                         arch: str = DEFAULT_ARCH, timeout: float = 900.0) -> tuple[Any, str]:
    """Call ``target`` (``"package.module:function"``) with ``kwargs`` (JSON values) in this process's
    compile child for ``arch`` (started on first use) and return (its JSON return value, what it printed).
    The artifacts the call wrote are moved to ``dump_dir`` (created if missing); with None they are
    dropped."""
    if dump_dir is not None:
        dump_dir = os.path.abspath(dump_dir)
        os.makedirs(dump_dir, exist_ok=True)
    with _CHILDREN_LOCK:
        child = _CHILDREN.get(arch)
        if child is None:
            child = _CHILDREN[arch] = _CompileChild(arch)
        return child.request(target, kwargs or {}, dump_dir, timeout)


def run_compile_check(
    target: str,
    dump_dir: str,
    kwargs: dict[str, Any] | None = None,
    arch: str = DEFAULT_ARCH,
    timeout: float = 900.0,
) -> CompileCheckResult:
    """Compile for ``arch`` in the compile child and report on the artifacts.

    ``target`` is ``"package.module:function"``; the child calls ``function(**kwargs)``, which must
    compile its kernel(s) inside ``expect_no_driver()`` (so it returns normally on a CPU-only machine).
    Then every PTX file it wrote, now in ``dump_dir``, is assembled by ptxas for the statistics.
    """
    _, output = run_in_compile_child(target, kwargs, dump_dir, arch, timeout)
    arts = find_artifacts(dump_dir, arch)
    stats: list[KernelStats] = []
    for ptx in arts["ptx"]:
        stats.extend(ptxas_report(ptx, arch))
    return CompileCheckResult(ptx=arts["ptx"], cubin=arts["cubin"], stats=stats, child_output=output)


__all__ = [
    "DEFAULT_ARCH",
    "artifact_env",
    "expect_no_driver",
    "compile_and_report",
    "find_artifacts",
    "KernelStats",
    "parse_ptxas_verbose",
    "find_ptxas",
    "ptxas_report",
    "CompileCheckResult",
    "run_in_compile_child",
    "run_compile_check",
]
