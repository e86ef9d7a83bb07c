"""Dump the PTX of every registered kernel variant (sm_90a, no GPU needed) and compare two dumps.

    python -m csrc_cute.ptx_compare dump DIR [--families gemm,comm] [--only SUBSTRING]
    python -m csrc_cute.ptx_compare diff DIR_A DIR_B
    python -m csrc_cute.ptx_compare list [--families ...]

``dump`` compiles each selected entry of ``FAMILIES`` (per kernel family a list of (name, compile
thunk)) in one child process with the DSL's artifact environment (``compile_check.artifact_env``) and
writes ``DIR/<name>.ptx``. ``--families`` takes family names and the groups of ``FAMILY_GROUPS``
(``comm``, ``planner``, ``all``: the default). ``diff`` normalises both sides (``normalise``: the names
of ``.entry``/``.func`` symbols, which carry the Python qualified name of the kernel, ``<locals>`` and
object addresses, become ``entry0``, ``func0``, ...; ``.file`` paths and ``.loc`` line numbers are
dropped) and compares them byte for byte; exit status 1 on any difference or a kernel present on one
side only.

Proves that a refactor of a kernel module leaves the generated code unchanged: dump before, dump after,
diff. A kernel family joins by adding its variants to ``FAMILIES``.
"""

from __future__ import annotations

import argparse
import importlib
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
# CTAs of the communication kernels (csrc_cute/status.py's DEFAULT_COMM_SMS), fixed here so that a
# dump compiles the same variants whatever the host wrappers' default becomes
COMM_NUM_CTAS = 32


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
    ("swiglu_bwd_smem", 7168, 2048, 128),
    ("swiglu_bwd_smem", 520, 200, 64),
    ("swiglu_h_only_remote", 7168, 2048, 128),
    ("swiglu_remote", 520, 200, 64),
    ("swiglu_remote", 7168, 2048, 128),
    ("swiglu_h_only_remote", 520, 200, 64),
    ("row_scale_remote", 2048, 7168, 128),
    ("row_scale_remote", 520, 200, 64),
    ("swiglu_gather", 7168, 2048, 128),
    ("swiglu_gather", 520, 200, 64),
    ("wgrad_gather", 7168, 2048, 128),
    ("wgrad_gather", 520, 136, 64),
    ("swiglu_bwd_gather", 7168, 2048, 128),
    ("swiglu_bwd_gather", 520, 200, 64),
    ("wgrad_gather_t", 7168, 2048, 128),
    ("wgrad_gather_t", 520, 136, 64),
]

# torch dtypes of the kernels' static arguments, written by name so that listing and diffing import
# neither torch nor cutlass; the child resolves them
_DTYPE_NAMES = ("int32", "int64", "bfloat16", "float16", "float32")


def _builder(module: str, builder: str, args: tuple) -> Callable[[], None]:
    """Thunk compiling one kernel through the module's own compile-cache entry
    ``csrc_cute.<module>.<builder>(*args)`` (what its host wrapper calls, one ``cute.compile``)."""

    def thunk() -> None:
        import torch

        fn = getattr(importlib.import_module(f"csrc_cute.{module}"), builder)
        fn(*(getattr(torch, a) if a in _DTYPE_NAMES else a for a in args))

    return thunk


def _variant(family: str, module: str, kind: str, builder: str, /, **static) -> tuple[str, Callable[[], None]]:
    """(name, thunk) of one kernel: the builder's static arguments in order; the name is
    ``<family>.<kind>.<key><value>...`` (dtypes and other names by value alone; an argument naming the
    kind itself, as sync's builder takes, not repeated)."""
    parts = [v if isinstance(v, str) else f"{k}{v}" for k, v in static.items() if v != kind]
    return ".".join([family, kind, *parts]), _builder(module, builder, tuple(static.values()))


def _plan_variants() -> list[tuple[str, Callable[[], None]]]:
    """count (id dtype; RB = 1 the live path, RB = R the simulated one) and plan_global (B = epn trains,
    B < epn adds remote groups, B = 0; R = 1)."""
    count = [dict(rb=1, n=8192 * 8, e=384, ids="int32"), dict(rb=8, n=8192 * 8, e=384, ids="int32"),
             dict(rb=1, n=7 * 6, e=12, ids="int64")]
    plans = [dict(r=8, e=384, b=48, p=128, tt=8192 * 8), dict(r=8, e=384, b=4, p=128, tt=4096 * 8),
             dict(r=2, e=12, b=0, p=16, tt=7 * 6), dict(r=1, e=8, b=0, p=128, tt=512 * 8)]
    return ([_variant("plan", "plan", "count", "_compile_count", **c) for c in count]
            + [_variant("plan", "plan", "global", "_compile_global", **c) for c in plans])


def _plan_tokens_variants() -> list[tuple[str, Callable[[], None]]]:
    """plan_tokens (csrc_cute/plan_tokens.py, compiled by plan.py): id dtype, B = epn / B < epn / B = 0,
    R = 1."""
    cfgs = [dict(s=8192, k=8, e=384, r=8, b=48, ids="int32"), dict(s=4096, k=8, e=384, r=8, b=4, ids="int32"),
            dict(s=7, k=6, e=12, r=2, b=0, ids="int64"), dict(s=512, k=8, e=8, r=1, b=0, ids="int32")]
    return [_variant("plan_tokens", "plan", "tokens", "_compile_tokens", **c) for c in cfgs]


def _sync_variants() -> list[tuple[str, Callable[[], None]]]:
    """barrier and exchange_counts at R = 1, 2, 8."""
    return [_variant("sync", "sync", kind, "_compile", kind=kind, r=r, e=e)
            for r, e in ((1, 48), (2, 96), (8, 384)) for kind in ("barrier", "exchange")]


def _dispatch_variants() -> list[tuple[str, Callable[[], None]]]:
    """meta and pull: the benchmark shape (bf16, R = 2), a small fp32 one (R = 4), R = 1."""
    out = []
    for s, h, k, r, g, nvs, dt in ((8192, 7168, 8, 2, 96, 77824, "bfloat16"), (7, 72, 6, 4, 6, 144, "float32"),
                                   (7, 64, 6, 1, 6, 144, "bfloat16")):
        out.append(_variant("dispatch", "dispatch", "meta", "_compile_meta", s=s, h=h, k=k, r=r, nvs=nvs, g=g,
                            dtype=dt, ncta=COMM_NUM_CTAS))
        out.append(_variant("dispatch", "dispatch", "pull", "_compile_pull", s=s, h=h, r=r, nvs=nvs, dtype=dt,
                            ncta=COMM_NUM_CTAS))
    return out


def _combine_variants() -> list[tuple[str, Callable[[], None]]]:
    """presum, pull and gather: the benchmark shape (bf16, R = 2), fp32 (R = 4), fp16 with a row of
    400 bytes (not a multiple of the vector width), R = 1."""
    out = []
    for s, h, k, r, nvs, dt in ((8192, 7168, 8, 2, 77824, "bfloat16"), (7, 72, 6, 4, 144, "float32"),
                                (9, 200, 5, 4, 144, "float16"), (7, 64, 6, 1, 144, "bfloat16")):
        out.append(_variant("combine", "combine", "presum", "_compile_presum", nvs=nvs, h=h, dtype=dt,
                            ncta=COMM_NUM_CTAS))
        out.append(_variant("combine", "combine", "pull", "_compile_pull", s=s, h=h, k=k, r=r, nvs=nvs, dtype=dt,
                            ncta=COMM_NUM_CTAS))
        out.append(_variant("combine", "combine", "gather", "_compile_gather", s=s, k=k, r=r, nvs=nvs,
                            ncta=COMM_NUM_CTAS))
    # the one-pass pull of combine_local (R = 1): the benchmark shape at E = 48
    out.append(_variant("combine", "combine", "pull", "_compile_pull", s=8192, h=7168, k=8, r=1, nvs=71680,
                        dtype="bfloat16", ncta=COMM_NUM_CTAS, local=True))
    return out


def _weights_variants() -> list[tuple[str, Callable[[], None]]]:
    """prefetch, reduce_pull and reduce_zero: the benchmark shape (R = 2, B = epn = 48, H = 7168,
    F = 2048) and a small one (R = 8, B = 4, epn = 8, H*F = 64*40)."""
    out = []
    for r, b, epn, hf in ((2, 48, 48, 7168 * 2048), (8, 4, 8, 64 * 40)):
        out.append(_variant("weights", "weights", "prefetch", "_compile_prefetch", r=r, b=b, epn=epn, hf=hf,
                            dtype="bfloat16", ncta=COMM_NUM_CTAS))
        out.append(_variant("weights", "weights", "reduce_pull", "_compile_reduce", r=r, b=b, epn=epn, hf=hf,
                            ncta=COMM_NUM_CTAS))
        out.append(_variant("weights", "weights", "reduce_zero", "_compile_zero", r=r, b=b, hf=hf,
                            ncta=COMM_NUM_CTAS))
    return out


# family -> [(name, thunk)]: each thunk compiles exactly one kernel (cute.compile) in a process whose DSL
# writes its PTX into the dump directory. Names are file names: letters, digits, '_', '-', '.'.
FAMILIES: dict[str, list[tuple[str, Callable[[], None]]]] = {
    "gemm": [(f"group_gemm.{op}.kd{kd}.nd{nd}.p{pad}", _gemm(op, kd, nd, pad)) for op, kd, nd, pad in _GEMM_VARIANTS],
    "plan": _plan_variants(),
    "plan_tokens": _plan_tokens_variants(),
    "sync": _sync_variants(),
    "dispatch": _dispatch_variants(),
    "combine": _combine_variants(),
    "weights": _weights_variants(),
}
FAMILY_GROUPS = {"comm": ("sync", "dispatch", "combine", "weights"), "planner": ("plan", "plan_tokens"),
                 "all": tuple(FAMILIES)}


def select_families(spec: str) -> list[str]:
    """The families of a comma-separated list of family and group names, in ``FAMILIES`` order."""
    chosen: set[str] = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item in FAMILY_GROUPS:
            chosen.update(FAMILY_GROUPS[item])
        elif item in FAMILIES:
            chosen.add(item)
        else:
            raise ValueError(f"ptx_compare: unknown family {item!r}; families: {', '.join(FAMILIES)}; "
                             f"groups: {', '.join(FAMILY_GROUPS)}")
    if not chosen:
        raise ValueError("ptx_compare: --families selects no family")
    return [f for f in FAMILIES if f in chosen]


def selected_kernels(families: str = "all", only: str = "") -> list[tuple[str, Callable[[], None]]]:
    """(name, thunk) of the kernels of ``families`` whose name contains ``only``."""
    return [(n, t) for f in select_families(families) for n, t in FAMILIES[f] if only in n]


def _dump_child(out_dir: str, scratch: str, families: str, only: str) -> None:
    """Child-process entry (artifact environment set): run each selected thunk, move the PTX it wrote
    from the DSL's dump directory ``scratch`` to ``out_dir/<name>.ptx``."""
    for name, thunk in selected_kernels(families, only):
        with expect_no_driver():
            thunk()
        ptx = [f for f in os.listdir(scratch) if f.endswith(f".{DUMP_ARCH}.ptx")]
        if len(ptx) != 1:
            raise RuntimeError(f"{name}: expected one PTX file from the compile, found {sorted(ptx)}")
        shutil.move(os.path.join(scratch, ptx[0]), os.path.join(out_dir, name + ".ptx"))
        for f in os.listdir(scratch):  # cubins and other artifacts of this compile
            os.remove(os.path.join(scratch, f))
        print(f"dumped {name}", flush=True)


def dump(out_dir: str, families: str = "all", only: str = "") -> None:
    if not selected_kernels(families, only):  # also rejects unknown family names before compiling
        raise SystemExit(f"ptx_compare: no kernel of families {families!r} has {only!r} in its name")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ptx_dump_") as scratch:
        env = dict(os.environ)
        env.update(artifact_env(scratch, DUMP_ARCH))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        code = ("import sys\nfrom csrc_cute.ptx_compare import _dump_child\n"
                "_dump_child(*sys.argv[1:])\n")
        proc = subprocess.run([sys.executable, "-c", code, os.path.abspath(out_dir), scratch, families, only],
                              env=env, cwd=root)
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
    families_help = (f"comma-separated families ({', '.join(FAMILIES)}) or groups ({', '.join(FAMILY_GROUPS)}); "
                     "default all")
    d = sub.add_parser("dump", help="compile the selected kernels for sm_90a and write DIR/<name>.ptx")
    d.add_argument("dir")
    d.add_argument("--families", default="all", help=families_help)
    d.add_argument("--only", default="", help="dump only the kernels whose name contains this")
    c = sub.add_parser("diff", help="compare two dumps after normalising symbol names; exit 1 on a difference")
    c.add_argument("dir_a")
    c.add_argument("dir_b")
    ls = sub.add_parser("list", help="print the registered kernel names")
    ls.add_argument("--families", default="all", help=families_help)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "dump":
            dump(args.dir, args.families, args.only)
            return 0
        if args.cmd == "list":
            print(json.dumps([n for n, _ in selected_kernels(args.families)], indent=1))
            return 0
    except ValueError as e:  # an unknown family name
        ap.error(str(e))
    return diff(args.dir_a, args.dir_b)


if __name__ == "__main__":
    sys.exit(main())
