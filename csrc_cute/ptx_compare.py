"""Dump the PTX of every registered kernel variant (sm_90a, no GPU needed) and compare two dumps.

    python -m csrc_cute.ptx_compare dump DIR [--only SUBSTRING]
    python -m csrc_cute.ptx_compare diff DIR_A DIR_B

``dump`` compiles each entry of ``KERNELS`` (a registry of (name, compile thunk)) in one child process
with the DSL's artifact environment (``compile_check.artifact_env``) and writes ``DIR/<name>.ptx``.
``diff`` normalises both sides (``normalise``: the names of ``.entry``/``.func`` symbols, which carry
the Python qualified name of the kernel, ``<locals>`` and object addresses, become ``entry0``,
``func0``, ...; ``.file`` paths and ``.loc`` line numbers are dropped) and compares them byte for byte;
exit status 1 on any difference or a kernel present on one side only.

Proves that a refactor of a kernel module leaves the generated code unchanged: dump before, dump after,
diff. Other kernel modules join by adding their variants to ``KERNELS``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

from csrc_cute.compile_check import artifact_env, expect_no_driver

DUMP_ARCH = "sm_90a"
GEMM_NUM_SMS = 132


def _gemm(op: str, kd: int, nd: int, pad: int) -> Callable[[], None]:
    """Thunk compiling one GEMM variant through the host module's single compile entry."""

    def thunk() -> None:
        from csrc_cute import group_gemm

        group_gemm.compile_op(op, kd, nd, pad, GEMM_NUM_SMS)

    return thunk


# Every GEMM variant the compile tests cover (tests/test_group_gemm_compile.py) and the default of
# compile_group_gemm_for_sm90: (op, Kd, Nd, P); for the SwiGLU ops Kd is H and Nd is F.
_GEMM_VARIANTS = [
    ("fwd", 7168, 2048, 128),
    ("fwd", 7168, 2048, 64),
    ("dgrad", 7168, 2048, 128),
    ("dgrad", 2048, 7168, 64),
    ("dgrad2", 7168, 2048, 128),
    ("dgrad2", 520, 200, 64),
    ("wgrad", 7168, 2048, 128),
    ("wgrad", 520, 136, 64),
    ("swiglu", 7168, 2048, 128),
    ("swiglu_h_only", 7168, 2048, 128),
    ("swiglu", 520, 200, 64),
    ("row_scale", 2048, 7168, 128),
    ("row_scale", 520, 200, 64),
    ("swiglu_bwd", 7168, 2048, 128),
    ("swiglu_bwd", 520, 200, 64),
    ("swiglu_h_only_remote", 7168, 2048, 128),
    ("swiglu_remote", 520, 200, 64),
    ("swiglu_remote", 7168, 2048, 128),
    ("swiglu_h_only_remote", 520, 200, 64),
    ("row_scale_remote", 2048, 7168, 128),
    ("row_scale_remote", 520, 200, 64),
]

# (name, thunk): the thunk compiles exactly one kernel (cute.compile) in a process whose DSL writes its
# PTX into the dump directory. Names are file names: letters, digits, '_', '-', '.'.
KERNELS: list[tuple[str, Callable[[], None]]] = [
    (f"group_gemm.{op}.kd{kd}.nd{nd}.p{pad}", _gemm(op, kd, nd, pad)) for op, kd, nd, pad in _GEMM_VARIANTS
]


def _dump_child(out_dir: str, scratch: str, only: str) -> None:
    """Child-process entry (artifact environment set): run each selected thunk, move the PTX it wrote
    from the DSL's dump directory ``scratch`` to ``out_dir/<name>.ptx``."""
    for name, thunk in KERNELS:
        if only not in name:
            continue
        with expect_no_driver():
            thunk()
        ptx = [f for f in os.listdir(scratch) if f.endswith(f".{DUMP_ARCH}.ptx")]
        if len(ptx) != 1:
            raise RuntimeError(f"{name}: expected one PTX file from the compile, found {sorted(ptx)}")
        shutil.move(os.path.join(scratch, ptx[0]), os.path.join(out_dir, name + ".ptx"))
        for f in os.listdir(scratch):  # cubins and other artifacts of this compile
            os.remove(os.path.join(scratch, f))
        print(f"dumped {name}", flush=True)


def dump(out_dir: str, only: str = "") -> None:
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ptx_dump_") as scratch:
        env = dict(os.environ)
        env.update(artifact_env(scratch, DUMP_ARCH))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        code = ("import sys\nfrom csrc_cute.ptx_compare import _dump_child\n"
                "_dump_child(sys.argv[1], sys.argv[2], sys.argv[3])\n")
        proc = subprocess.run([sys.executable, "-c", code, os.path.abspath(out_dir), scratch, only], env=env,
                              cwd=root)
    if proc.returncode != 0:
        raise SystemExit(f"dump failed (rc={proc.returncode})")


_RE_SYMBOL_DECL = re.compile(r"\.(entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$.]*)")


def normalise(ptx: str) -> str:
    """PTX with what depends on where the kernel's Python code lives replaced: every ``.entry`` and ``.func``
    symbol (and the parameters named after it) renamed by order of first declaration, ``.file`` directives and
    ``.loc`` line markers dropped (source positions, not code), the DSL's trailing NUL stripped."""
    ptx = ptx.rstrip("\0")
    names: dict[str, str] = {}
    counts = {"entry": 0, "func": 0}
    for m in _RE_SYMBOL_DECL.finditer(ptx):
        kind, name = m.groups()
        if name not in names:
            names[name] = f"{kind}{counts[kind]}"
            counts[kind] += 1
    # substring replacement: parameters are named <symbol>_param_<i>
    for name in sorted(names, key=len, reverse=True):
        ptx = ptx.replace(name, names[name])
    lines = [ln for ln in ptx.split("\n") if not re.match(r"\s*\.(file|loc)\b", ln)]
    return "\n".join(lines)


def diff(dir_a: str, dir_b: str) -> int:
    """Compare the normalised PTX of two dumps; prints one line per kernel, returns the exit status."""
    a = {f for f in os.listdir(dir_a) if f.endswith(".ptx")}
    b = {f for f in os.listdir(dir_b) if f.endswith(".ptx")}
    status = 0
    for f in sorted(a ^ b):
        print(f"ONLY IN {dir_a if f in a else dir_b}: {f}")
        status = 1
    for f in sorted(a & b):
        texts = []
        for d in (dir_a, dir_b):
            with open(os.path.join(d, f), "rb") as fh:
                texts.append(normalise(fh.read().decode()).encode())
        same = texts[0] == texts[1]
        print(f"{'same' if same else 'DIFFERENT'}: {f} ({len(texts[0])} / {len(texts[1])} bytes normalised)")
        status |= 0 if same else 1
    if not a and not b:
        print("no PTX files in either directory")
        status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m csrc_cute.ptx_compare", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="compile every registered kernel for sm_90a and write DIR/<name>.ptx")
    d.add_argument("dir")
    d.add_argument("--only", default="", help="dump only the kernels whose name contains this")
    c = sub.add_parser("diff", help="compare two dumps after normalising symbol names; exit 1 on a difference")
    c.add_argument("dir_a")
    c.add_argument("dir_b")
    sub.add_parser("list", help="print the registered kernel names")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        dump(args.dir, args.only)
        return 0
    if args.cmd == "list":
        print(json.dumps([n for n, _ in KERNELS], indent=1))
        return 0
    return diff(args.dir_a, args.dir_b)


if __name__ == "__main__":
    sys.exit(main())
