"""GPU planner latency (CuTe DSL kernels), CUDA-graph replay.

    python benchmarks/bench_planner.py [--out DIR]

S=8192, K=8. (1) R=8/E=384 and R=64/E=2048 simulated on one GPU (all ranks' top-k ids on the device),
at a mild and a strong skew: each stage and one rank's whole planner compute (count + global plan +
token destinations). (2) With >= 2 GPUs, real ranks (R = all GPUs, E = 48*R): the `moonep::plan` op end
to end (count, NVLink count exchange + barrier, global plan, token destinations), and the exchange +
barrier alone.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_info, write_json  # noqa: E402
from benchmarks.routing_gen import sample_topk  # noqa: E402
from moonep_ops import planning  # noqa: E402
from moonep_ops.launch import run_ranks  # noqa: E402


def graph_replay_us(fn, iters: int = 100, back_to_back: int = 20) -> tuple[float, float]:
    """(median of one isolated replay, median per replay of `back_to_back` replays in a row), in us."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    one, many = [], []
    for _ in range(iters):
        a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        graph.replay()
        b.record()
        for _ in range(back_to_back):
            graph.replay()
        c.record()
        c.synchronize()
        one.append(a.elapsed_time(b) * 1000.0)
        many.append(b.elapsed_time(c) * 1000.0 / back_to_back)
    return sorted(one)[iters // 2], sorted(many)[iters // 2]


def real_ranks(rank: int, R: int, S: int, K: int) -> list[dict]:
    """One process per GPU: the whole plan op, and the count exchange + barrier alone (rank 0 reports)."""
    import moonep_ops  # noqa: F401  (registers the ops)
    from csrc_cute import sync
    from moonep_ops import EPConfig, EPGroup
    from moonep_ops.registry import peers

    E = 48 * R
    cfg = EPConfig(S=S, H=8, K=K, E=E, F=8, R=R)
    ep = EPGroup(cfg, device="cuda")
    rows = []
    for sigma in (0.3, 2.0):
        ids_all = sample_topk(R, S, E, K, sigma, seed=1, device="cuda")
        ids = ids_all[rank].int().contiguous()
        counts = torch.zeros(R, E, dtype=torch.int32, device="cuda")
        stages = {
            "exchange + barrier": lambda: sync.exchange_counts(peers("bench", "ctrl", ep.ctrl), ep.ctrl, counts,
                                                               rank),
            "moonep::plan": lambda: torch.ops.moonep.plan(ids, E, cfg.B, cfg.P, R, ep.ctrl, ep.group_name),
        }
        mv = planning.maxvio(torch.stack([torch.bincount(i.reshape(-1).cpu(), minlength=E) for i in ids_all]))
        for stage, fn in stages.items():
            isolated, back = graph_replay_us(fn)
            rows.append(dict(R=R, E=E, B=cfg.B, S=S, K=K, sigma=sigma, maxvio=mv, stage=stage, real_ranks=True,
                             isolated_us=isolated, back_to_back_us=back))
    assert int(ep.status.item()) == 0
    ep.destroy()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from csrc_cute import plan as P

    S, K, Pad = 8192, 8, 128
    rows = []
    for R, E, B in ((8, 384, 48), (64, 2048, 32)):
        for sigma in (0.3, 2.0):
            ids = torch.stack(sample_topk(R, S, E, K, sigma, seed=1, device="cuda")).int()
            status = torch.zeros(1, dtype=torch.int32, device="cuda")
            counts, plan, _, _ = P.plan_simulated(ids, E=E, B=B, P=Pad, rank=0, status=status)
            one = ids[0].contiguous()
            stages = {
                "count (one rank)": lambda: P.count_experts(one, E, status),
                "plan_global": lambda: P.plan_global_cuda(counts, S, K, B, Pad, status),
                "plan_tokens": lambda: P.plan_tokens_cuda(one, counts, plan, 0, status),
                "one rank's planner": lambda: (
                    P.count_experts(one, E, status), P.plan_global_cuda(counts, S, K, B, Pad, status),
                    P.plan_tokens_cuda(one, counts, plan, 0, status)),
            }
            mv = planning.maxvio(counts.cpu())
            for stage, fn in stages.items():
                isolated, back = graph_replay_us(fn)
                rows.append(dict(R=R, E=E, B=B, S=S, K=K, sigma=sigma, maxvio=mv, stage=stage,
                                 isolated_us=isolated, back_to_back_us=back))
                print(f"R={R:2d} E={E:4d} maxvio {mv:6.2f}  {stage:20s} {isolated:7.1f} us isolated, "
                      f"{back:7.1f} us back-to-back", flush=True)
            assert int(status.item()) == 0
    n_gpus = torch.cuda.device_count()
    if n_gpus >= 2:
        for r in run_ranks(real_ranks, n_gpus, S, K, backend="nccl")[0]:
            rows.append(r)
            print(f"R={r['R']:2d} E={r['E']:4d} maxvio {r['maxvio']:6.2f}  {r['stage']:20s} "
                  f"{r['isolated_us']:7.1f} us isolated, {r['back_to_back_us']:7.1f} us back-to-back (real ranks)",
                  flush=True)
    path = write_json("bench_planner.json", dict(run_info(), results=rows), args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
