"""Cold start: how long a fresh process takes from its imports to its first training step of one MoE
layer (R=1, one GPU, bf16; the DESIGN shape by default), for a first process that finds the kernel disk
cache empty and a second process that finds what the first one compiled there (csrc_cute/jit.py).

    python3 benchmarks/bench_cold_start.py [--S 8192 --H 7168 --F 2048 --E 48 --K 8] [--out DIR]
    python3 benchmarks/bench_cold_start.py --smoke --out DIR      # CPU reference ops, tiny shape

Each process reports: import (torch + moonep_ops), init (device context, EPGroup, MoELayer, and the CuTe
DSL runtime's import, each also apart), first forward, first backward (synchronised wall times), the
second step, and the cache's entries after it. The first forward compiles the step's kernels ahead, side
by side in `compile_workers` processes (moonep_ops/functional.py, `precompile`), so the first backward
only loads. Written to
DIR/bench_cold_start.json (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_T_START = time.perf_counter()  # before torch is imported: the child's import time starts here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SMOKE = dict(S=16, H=32, F=16, E=8, K=2, device="cpu")


def _child(args) -> dict:
    """One process's figures (this runs in the measured process itself)."""
    import torch

    from moonep_ops import EPConfig, EPGroup, MoELayer

    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def lap(t):
        sync()
        return time.perf_counter() - t

    out = dict(import_s=time.perf_counter() - _T_START)
    t0 = t = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(args.S, args.H, device=device, dtype=dtype)  # on CUDA: the context is created here
    g = torch.randn_like(x)
    out["device_init_s"] = lap(t)
    t = time.perf_counter()
    ep = EPGroup(EPConfig(S=args.S, H=args.H, F=args.F, E=args.E, K=args.K, R=1), dtype=dtype, device=device)
    out["ep_group_s"] = lap(t)
    t = time.perf_counter()
    layer = MoELayer(ep)
    out["layer_s"] = lap(t)
    t = time.perf_counter()
    import cutlass  # noqa: F401  (the kernels' runtime, imported on first use: part of the first step)

    out["cute_import_s"] = lap(t)
    out["init_s"] = lap(t0)
    steps = []
    for _ in range(2):
        t = time.perf_counter()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        fwd = lap(t)
        y.backward(g)
        steps.append((fwd, lap(t) - fwd))
    ep.check("cold start")
    (out["first_forward_s"], out["first_backward_s"]), second = steps
    out["second_step_ms"] = 1e3 * sum(second)
    out["first_step_after_import_s"] = out["init_s"] + out["first_forward_s"] + out["first_backward_s"]
    from csrc_cute.jit import compile_workers

    out["compile_workers"] = compile_workers()  # processes that compiled the first step's kernels ahead
    cache = os.environ.get("MOONEP_CUTE_CACHE_DIR", "")
    out["cache_entries"] = sum(f.endswith(".o") for _, _, files in os.walk(cache) for f in files) \
        if os.path.isdir(cache) else 0  # compiled kernels (not their .lock files)
    return out


def _spawn(argv: list[str], cache: str, pycache: str | None) -> dict:
    env = dict(os.environ, MOONEP_CUTE_CACHE_DIR=cache)
    if pycache is not None:
        env["PYTHONPYCACHEPREFIX"] = pycache
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # set on some machines: the first process must write
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_cold_start: the measured process failed:\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = time.perf_counter() - t
    if pycache is not None:  # the bytecode the shared prefix holds after this process (proof it is used)
        res["pycache_files"] = sum(f.endswith(".pyc") for _, _, files in os.walk(pycache) for f in files)
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in dict(S=8192, H=7168, F=2048, E=48, K=8).items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny CPU shape (options given still win)")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results/)")
    p.add_argument("--pycache", default="shared", choices=["shared", "as-installed"],
                   help="shared (default): both processes write and read Python bytecode in one temporary "
                        "PYTHONPYCACHEPREFIX, so the second finds what the first compiled, as on a byte-compiled "
                        "install (the H200 machine's torch ships no .pyc in a read-only site-packages: every "
                        "process there compiles ~800 torch sources again, ~3 s); as-installed: leave it to the "
                        "installation")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        from benchmarks.common import apply_smoke_defaults

        apply_smoke_defaults(args, argv, SMOKE)
    shape = [f"--{k}={getattr(args, k)}" for k in ("S", "H", "F", "E", "K", "device")]
    if args.child:
        print(json.dumps(_child(args)))
        return
    from benchmarks.common import run_info, write_json

    with tempfile.TemporaryDirectory(prefix="moonep_cold_") as cache:
        pycache = os.path.join(cache, "pycache") if args.pycache == "shared" else None
        runs = {"first_process": _spawn(shape, cache, pycache), "second_process": _spawn(shape, cache, pycache)}
    payload = dict(run_info(), shape={k: getattr(args, k) for k in ("S", "H", "F", "E", "K")}, device=args.device,
                   pycache=args.pycache, **runs)
    path = write_json("bench_cold_start.json", payload, args.out)
    keys = ("import_s", "device_init_s", "ep_group_s", "cute_import_s", "init_s", "first_forward_s",
            "first_backward_s", "first_step_after_import_s", "second_step_ms", "cache_entries")
    print(f"{'':16}" + "".join(f"{k:>{len(k) + 2}}" for k in keys))
    for name, r in runs.items():
        print(f"{name:16}" + "".join(f"{r[k]:{len(k) + 2}.3f}" for k in keys))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
