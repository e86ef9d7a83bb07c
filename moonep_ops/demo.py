"""Demo: train a small EP MoE with a deliberately skewed router; every rank computes exactly S*K rows (all S tokens present).

    python -m moonep_ops.demo [--ranks 2] [--steps 40] [--device auto|cpu|cuda]

With `--device cuda` (and `auto`, when `--ranks` GPUs exist and the CUDA kernels load) it runs the CuTe
DSL kernels on `--ranks` GPUs over NCCL and symmetric memory (bf16, P=64); otherwise it spawns
`--ranks` gloo processes and runs the reference ops on the CPU.
The student MoE learns to imitate a fixed teacher MoE; its router starts biased towards a few
experts, so the plan copies experts to keep the ranks balanced.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from . import EPConfig, EPGroup, MoELayer, dense_moe
from .group import cuda_kernels_available
from .launch import run_ranks
from .planning import maxvio, plan_global


def make_teacher(cfg: EPConfig, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    H, E, F = cfg.H, cfg.E, cfg.F
    return (torch.randn(E, H, generator=g) / H ** 0.5, torch.randn(E, H, F, generator=g) / H ** 0.5,
            torch.randn(E, H, F, generator=g) / H ** 0.5, torch.randn(E, F, H, generator=g) / F ** 0.5)


def train(rank: int, world_size: int, cfg_kwargs: dict, steps: int, device: str, lr: float):
    cfg = EPConfig(R=world_size, **cfg_kwargs)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the CUDA grouped GEMM is bf16
    ep = EPGroup(cfg, dtype=dtype, device=dev)
    torch.manual_seed(0)  # same router init everywhere; experts differ per rank through their slice
    layer = MoELayer(ep)
    with torch.no_grad():  # skew: feature 0 of every token is large, and pushes towards the last experts
        layer.router.weight[:, 0] = torch.linspace(-1, 1, cfg.E)
    teacher = make_teacher(cfg)
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    data = torch.Generator().manual_seed(1000 + rank)
    log = []
    for step in range(steps):
        x = torch.randn(cfg.S, cfg.H, generator=data)
        x[:, 0] = x[:, 0].abs() + 1
        with torch.no_grad():
            target = dense_moe(x, *teacher, K=cfg.K)
        x, target = x.to(dev, dtype), target.to(dev)
        loss = torch.nn.functional.mse_loss(layer(x).float(), target)
        opt.zero_grad()
        loss.backward()
        # the router is replicated (data parallel): average its gradient; experts are EP-sharded
        dist.all_reduce(layer.router.weight.grad, group=ep.group)
        layer.router.weight.grad /= world_size
        opt.step()
        loss_all = loss.detach().clone()
        dist.all_reduce(loss_all, group=ep.group)
        counts = layer.last_counts.cpu()
        plan = plan_global(counts, cfg.S, cfg.K, cfg.B, cfg.P)  # the plan every rank used, for display
        entry = dict(step=step, loss=float(loss_all) / world_size, maxvio=maxvio(counts),
                     home=counts.sum(0).view(world_size, -1).sum(1).tolist(), rows=plan.alloc.sum(0).tolist(),
                     copies=plan.n_copies)
        log.append(entry)
        if rank == 0:
            bar = "#" * ((step + 1) * 20 // steps)
            print(f"step {step + 1:3d}/{steps} [{bar:<20}] loss {entry['loss']:.4f}  maxvio {entry['maxvio']:5.2f}  "
                  f"routed to home experts {entry['home']} -> rows computed {entry['rows']}  "
                  f"copied experts {entry['copies']}", flush=True)
    ep.destroy()
    return log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args(argv)
    gpu_ready = torch.cuda.device_count() >= args.ranks and cuda_kernels_available()
    if args.device == "cuda" and not gpu_ready:
        ap.error(f"--device cuda needs {args.ranks} GPUs and the moonep CUDA kernels "
                 f"(GPUs: {torch.cuda.device_count()}, kernels registered: {cuda_kernels_available()})")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and gpu_ready) else "cpu"
    cfg_kwargs = dict(S=128, H=32, K=4, E=8 * args.ranks, F=32, P=16)
    if device == "cuda":  # the CUDA grouped GEMM tiles 64 rows: groups padded to P=64
        cfg_kwargs = dict(S=256, H=128, K=4, E=8 * args.ranks, F=64, P=64)
    print(f"moonep_ops demo: {args.ranks} ranks on {device} ({'NCCL' if device == 'cuda' else 'gloo'}), "
          f"S={cfg_kwargs['S']} K={cfg_kwargs['K']} E={cfg_kwargs['E']}: every rank computes exactly "
          f"S*K={cfg_kwargs['S'] * cfg_kwargs['K']} rows", flush=True)
    t0 = time.time()
    logs = run_ranks(train, args.ranks, cfg_kwargs, args.steps, device, args.lr,
                     backend="nccl" if device == "cuda" else "gloo")
    log = logs[0]
    balanced = all(r == cfg_kwargs["S"] * cfg_kwargs["K"] for e in log for r in e["rows"])
    print(f"done in {time.time() - t0:.1f}s: loss {log[0]['loss']:.4f} -> {log[-1]['loss']:.4f}, "
          f"max maxvio {max(e['maxvio'] for e in log):.2f}, every rank computed S*K rows at every step: {balanced}")
    return 0 if balanced else 1


if __name__ == "__main__":
    sys.exit(main())
