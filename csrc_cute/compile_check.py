"""Compile CuTe DSL kernels for a GPU arch on a machine without a GPU, and report on the result.

Shared by every kernel in ``csrc_cute``: CI compiles each kernel for ``sm_90a`` on CPU-only machines.

How it works (CuTe DSL 4.4.2): with ``CUTE_DSL_ARCH=<arch>``, ``CUTE_DSL_KEEP_PTX=1``,
``CUTE_DSL_KEEP_CUBIN=1`` and ``CUTE_DSL_DUMP_DIR=<dir>`` in the environment, ``cute.compile`` writes
``<dir>/<function>.<arch>.ptx`` and ``.cubin`` and only then tries to load the cubin, which fails with a
``DSLRuntimeError`` caused by ``CudaDriverDependencyError`` when there is no libcuda. The DSL reads those
variables once, when it is first used in a process, so the compile runs in a fresh child process
(``run_compile_check``); inside that child, ``expect_no_driver`` turns exactly that failure into a normal
return and lets every other error through. ``ptxas -arch=<arch> -v`` on the PTX then reports registers,
shared memory, stack frame and spills per kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
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
            )
        return "\n".join(lines)


def run_compile_check(
    target: str,
    dump_dir: str,
    kwargs: dict[str, Any] | None = None,
    arch: str = DEFAULT_ARCH,
    timeout: float = 900.0,
) -> CompileCheckResult:
    """Compile for ``arch`` in a fresh process and report on the artifacts.

    ``target`` is ``"package.module:function"``; the child calls ``function(**kwargs)``, which must
    compile its kernel(s) inside ``expect_no_driver()`` (so it returns normally on a CPU-only machine).
    Then every PTX file found in ``dump_dir`` is assembled by ptxas for the statistics.
    """
    os.makedirs(dump_dir, exist_ok=True)
    env = dict(os.environ)
    env.update(artifact_env(dump_dir, arch))
    mod, _, fn = target.partition(":")
    code = (
        "import json, sys, importlib\n"
        f"m = importlib.import_module({mod!r})\n"
        f"getattr(m, {fn!r})(**json.loads(sys.argv[1]))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(kwargs or {})],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"compile of {target} for {arch} failed (rc={proc.returncode}):\n{output}")
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
    "run_compile_check",
]
