"""Grouped GEMM forward on one GPU: the CuTe DSL kernel against torch._grouped_mm and dense torch.mm.

    python benchmarks/bench_gemm.py [--out DIR]

Cases (DESIGN.md shapes, H=7168, F=2048): (a) 48 equal groups, 65536 rows; (b) the groups of one rank
after balancing a skewed routing (R=2, E=96, K=8, S=8192, maxvio 5); (c) 16 groups x 2048 rows; each for
the gate/up projection (H -> F) and the down projection (F -> H). Only the forward exists in CuTe DSL
so far; dgrad, wgrad and fused SwiGLU are not measured.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cuda_time_ms, run_info, write_json  # noqa: E402
from benchmarks.routing_gen import counts_of, routing_for_maxvio  # noqa: E402
from moonep_ops.planning import plan_global  # noqa: E402


def group_cases(P: int = 128):
    """name -> (cu_seqlens [G] int32, epn): group ends, home groups first."""
    sizes = [65536 // 48 // P * P] * 48  # equal groups, padded to P
    sizes[-1] += 65536 - sum(sizes)
    cases = {"a: 48 equal groups, 65536 rows": (torch.tensor(sizes).cumsum(0), 48)}
    ids, _, mv = routing_for_maxvio(2, 8192, 96, 8, 5.0, seed=0)
    plan = plan_global(counts_of(ids, 96), 8192, 8, 48, P)
    cases[f"b: rank 0 after balancing maxvio {mv:.1f}"] = (plan.cu_seqlens[0].long(), 48)
    cases["c: 16 x 2048 rows"] = (torch.arange(1, 17) * 2048, 16)
    return {k: (cu.to(torch.int32), epn) for k, (cu, epn) in cases.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from csrc_cute.group_gemm import group_gemm_fwd

    H, F, P = 7168, 2048, 128
    rows = []
    for name, (cu_cpu, epn) in group_cases(P).items():
        G = cu_cpu.numel()
        n = int(cu_cpu[-1])
        cu = cu_cpu.cuda()
        for proj, (kd, nd) in (("gate/up H->F", (H, F)), ("down F->H", (F, H))):
            x = torch.randn(n, kd, device="cuda", dtype=torch.bfloat16)
            w_home = torch.randn(epn, kd, nd, device="cuda", dtype=torch.bfloat16) / kd ** 0.5
            w_slot = torch.randn(G - epn, kd, nd, device="cuda", dtype=torch.bfloat16) / kd ** 0.5
            w_all = torch.cat([w_home, w_slot])  # the baseline needs one weight tensor
            out = torch.empty(n, nd, device="cuda", dtype=torch.bfloat16)
            flops = 2.0 * n * kd * nd  # every row of every group, padding included: both kernels compute it
            ours = cuda_time_ms(lambda: group_gemm_fwd(x, w_home, w_slot, cu, pad=P, out=out))
            ref = torch._grouped_mm(x, w_all, offs=cu)
            base = cuda_time_ms(lambda: torch._grouped_mm(x, w_all, offs=cu))
            torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
            dense = cuda_time_ms(lambda: torch.mm(x, w_all[0]))
            row = dict(case=name, proj=proj, groups=G, rows=n, kd=kd, nd=nd, ours_ms=ours, grouped_mm_ms=base,
                       dense_mm_ms=dense, ours_tflops=flops / ours / 1e9, grouped_mm_tflops=flops / base / 1e9,
                       dense_tflops=flops / dense / 1e9, speedup=base / ours)
            rows.append(row)
            print(f"{name:42s} {proj:13s} ours {ours:7.3f} ms {row['ours_tflops']:6.1f} TF/s | _grouped_mm "
                  f"{base:7.3f} ms {row['grouped_mm_tflops']:6.1f} TF/s | dense {row['dense_tflops']:6.1f} TF/s | "
                  f"x{row['speedup']:.3f}", flush=True)
    path = write_json("bench_gemm.json", dict(run_info(), results=rows), args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
