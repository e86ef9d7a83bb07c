"""Grouped GEMM forward, dgrad and wgrad on one GPU: the CuTe DSL kernels against torch._grouped_mm
doing the same math, and dense torch.mm.

    python benchmarks/bench_gemm.py [--out DIR]

Cases (DESIGN.md shapes, H=7168, F=2048): (a) 48 equal groups, 65536 rows; (b) the groups of one rank
after balancing a skewed routing (R=2, E=96, K=8, S=8192, maxvio 5); (c) 16 groups x 2048 rows; each for
the gate/up projection (H -> F) and the down projection (F -> H), and for each of
  fwd    y = x @ W_g                 vs _grouped_mm(x, W, offs)
  dgrad  dx = dy @ W_g^T             vs _grouped_mm(dy, W.transpose(-1, -2), offs)
  wgrad  dW_g = x_g^T @ dy_g vs _grouped_mm(x.t(), dy, offs) (2d x 2d -> [G, Kd, Nd], bf16 out), like for
         like: every group is passed as a home group, which our kernel writes as a fresh bf16 gradient
         (fp32 accumulation, one rounding, 2 bytes per weight as _grouped_mm); no slot groups
  wgrad_ep  (cases with slot groups) the MoE layer's layout: home groups written bf16, slot groups
         accumulated into fp32 reduce buffers (read-add-write, 8 bytes per weight) vs the same baseline
and the fused epilogues (same run, same shapes):
  swiglu       h, gate, up = group_gemm_swiglu(x, W_gate, W_up) (one kernel, pre-activations stored for
               backward) vs _grouped_mm gate + _grouped_mm up + F.silu(gate) * up ("unfused pair"), and
               vs one _grouped_mm on [G, H, 2F] concatenated weights + the same activation ("cat 2F")
  swiglu_h     the same kernel storing h only (inference)
  swiglu_gather  group_gemm_swiglu_gather(x [S, H], row_src, ...): the rows gathered from S = 8192 tokens
               in the kernel (row_src random tokens, every row routed) vs group_gemm_swiglu on the
               pre-gathered rows x[row_src] (bitwise equal), and vs the gather copy + that kernel
  wgrad_gather  group_gemm_wgrad_gather(x [S, H], row_src, dy, ...): the gate/up projection's wgrad
               (dW = rows^T dy, H x F) with the rows gathered from S = 8192 tokens in the kernel (home
               groups written bf16, slot groups accumulated fp32) vs group_gemm_wgrad on x[row_src]
               (bitwise equal), and vs the gather copy + that kernel
  swiglu_bwd_gather  group_gemm_swiglu_bwd_gather(g_out [S, H], row_src, ...): the SwiGLU-backward dgrad
               with g_y = g_out[row_src] gathered from S = 8192 tokens in the kernel vs group_gemm_swiglu_bwd
               on the pre-gathered g_y (bitwise equal), and vs the gather copy + that kernel
  wgrad_gather_b  group_gemm_wgrad_gather_b(h_w, g_out [S, H], row_src, ...): the down projection's wgrad
               (dW = h_w^T g_y, F x H) with g_y's rows gathered from S = 8192 tokens in the kernel vs
               group_gemm_wgrad on g_out[row_src] (bitwise equal), and vs the gather copy + that kernel
  row_scale    y = (h @ W_down_g) * row_w (fp32 scale in the epilogue) vs _grouped_mm(...).mul_(row_w)
  swiglu_bwd   down-projection dgrad d = g_y @ W_down_g^T with the SwiGLU backward in the epilogue
               (g_gate, g_up, h_w = row_w * h, g_row_w = sum_f d * h from the saved gate/up) vs
               _grouped_mm dgrad + the same elementwise math in eager torch (fp32)
  swiglu_bwd_smem  the same kernel with its shared-memory epilogue (gate/up and the outputs by TMA)
FLOPs are the GEMM FLOPs only (swiglu: 2 * N * H * 2F).

    python benchmarks/bench_gemm.py --only swiglu,swiglu_h,row_scale,swiglu_bwd   # writes bench_gemm_fused.json
    python benchmarks/bench_gemm.py --only swiglu_bwd,swiglu_bwd_smem             # the two epilogues side by side
    python benchmarks/bench_gemm.py --only swiglu,swiglu_gather                    # gathered A vs pre-gathered rows
    python benchmarks/bench_gemm.py --only wgrad_gather                             # the same for the wgrad
    python benchmarks/bench_gemm.py --only swiglu_bwd_gather,wgrad_gather_b          # backward: g_y gathered
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
    ap.add_argument("--only", default=None,
                    help="comma-separated ops (fwd,dgrad,dgrad2,wgrad,swiglu,swiglu_h,row_scale,swiglu_bwd,"
                         "swiglu_bwd_smem,swiglu_gather,wgrad_gather,swiglu_bwd_gather,wgrad_gather_b; wgrad "
                         "includes wgrad_ep)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    from csrc_cute.group_gemm import (group_gemm_dgrad, group_gemm_dgrad2, group_gemm_fwd, group_gemm_row_scale, group_gemm_swiglu,
                                      group_gemm_swiglu_bwd, group_gemm_swiglu_bwd_gather, group_gemm_swiglu_gather,
                                      group_gemm_wgrad, group_gemm_wgrad_gather, group_gemm_wgrad_gather_b)

    H, F, P = 7168, 2048, 128
    rows = []
    for name, (cu_cpu, epn) in group_cases(P).items():
        G = cu_cpu.numel()
        n = int(cu_cpu[-1])
        cu = cu_cpu.cuda()
        for proj, (kd, nd) in (("gate/up H->F", (H, F)), ("down F->H", (F, H))):
            x = torch.randn(n, kd, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(n, nd, device="cuda", dtype=torch.bfloat16)
            w_home = torch.randn(epn, kd, nd, device="cuda", dtype=torch.bfloat16) / kd ** 0.5
            w_slot = torch.randn(G - epn, kd, nd, device="cuda", dtype=torch.bfloat16) / kd ** 0.5
            w_all = torch.cat([w_home, w_slot])  # the baseline needs one weight tensor
            flops = 2.0 * n * kd * nd  # every row of every group, padding included: both kernels compute it
            out = torch.empty(n, nd, device="cuda", dtype=torch.bfloat16)
            dx = torch.empty(n, kd, device="cuda", dtype=torch.bfloat16)
            # like for like with _grouped_mm: all G groups are home groups (written bf16), no slots
            dw_all = torch.empty(G, kd, nd, device="cuda", dtype=torch.bfloat16)
            no_slots = torch.empty(0, kd, nd, device="cuda", dtype=torch.float32)
            # the layer's layout: epn home groups (bf16, written), G - epn slots (fp32, accumulated)
            dw_home = torch.empty(epn, kd, nd, device="cuda", dtype=torch.bfloat16)
            dw_slot = torch.zeros(G - epn, kd, nd, device="cuda", dtype=torch.float32)
            w_t = w_all.transpose(-1, -2)
            x_t = x.t()
            variants = {
                "fwd": (lambda: group_gemm_fwd(x, w_home, w_slot, cu, pad=P, out=out),
                        lambda: torch._grouped_mm(x, w_all, offs=cu), lambda: torch.mm(x, w_all[0])),
                "dgrad": (lambda: group_gemm_dgrad(dy, w_home, w_slot, cu, pad=P, out=dx),
                          lambda: torch._grouped_mm(dy, w_t, offs=cu), lambda: torch.mm(dy, w_t[0])),
                "wgrad": (lambda: group_gemm_wgrad(x, dy, cu, dw_all, no_slots, pad=P),
                          lambda: torch._grouped_mm(x_t, dy, offs=cu), lambda: torch.mm(x_t, dy)),
            }
            if proj == "gate/up H->F":
                # the gate and up projections' input gradient: ours one GEMM of both pairs (one fp32
                # accumulator, one store), the baseline two grouped GEMMs and a bf16 add
                dy_up = torch.randn(n, nd, device="cuda", dtype=torch.bfloat16)
                w_up_home, w_up_slot = w_home * -0.5, w_slot * 2
                w_up_t = torch.cat([w_up_home, w_up_slot]).transpose(-1, -2)
                variants["dgrad2"] = (
                    lambda: group_gemm_dgrad2(dy, w_home, w_slot, dy_up, w_up_home, w_up_slot, cu, pad=P, out=dx),
                    lambda: torch._grouped_mm(dy, w_t, offs=cu) + torch._grouped_mm(dy_up, w_up_t, offs=cu),
                    lambda: torch.mm(dy, w_t[0]) + torch.mm(dy_up, w_up_t[0]))
            if G > epn:
                variants["wgrad_ep"] = (lambda: group_gemm_wgrad(x, dy, cu, dw_home, dw_slot, pad=P),
                                        lambda: torch._grouped_mm(x_t, dy, offs=cu), lambda: torch.mm(x_t, dy))
            variants = {k: v for k, v in variants.items()
                        if only is None or k in only or k.removesuffix("_ep") in only}
            for op, (ours_fn, base_fn, dense_fn) in variants.items():
                # correctness first (wgrad_ep: one call onto zeroed slot gradients), then timings
                dw_slot.zero_()
                ours_fn()
                ref = base_fn()
                if op == "wgrad_ep":
                    got = torch.cat([dw_home.float(), dw_slot])
                else:
                    got = {"fwd": out, "dgrad": dx, "dgrad2": dx, "wgrad": dw_all}[op]
                err = (got.float() - ref.float()).abs().max().item()
                ok = torch.allclose(got.float(), ref.float(), atol=5e-2, rtol=5e-2)
                if not ok:  # recorded and reported, the timings still run
                    print(f"MISMATCH {name} {proj} {op}: max abs err {err:.3g} vs torch._grouped_mm", flush=True)
                ours = cuda_time_ms(ours_fn)
                base = cuda_time_ms(base_fn)
                dense = cuda_time_ms(dense_fn)
                op_flops = 2 * flops if op == "dgrad2" else flops  # two products per row
                row = dict(case=name, proj=proj, op=op, groups=G, rows=n, kd=kd, nd=nd, ours_ms=ours,
                           grouped_mm_ms=base, dense_mm_ms=dense, ours_tflops=op_flops / ours / 1e9,
                           grouped_mm_tflops=op_flops / base / 1e9, dense_tflops=op_flops / dense / 1e9,
                           speedup=base / ours, matches_grouped_mm=ok, max_abs_err=err)
                rows.append(row)
                print(f"{name:42s} {proj:13s} {op:8s} ours {ours:7.3f} ms {row['ours_tflops']:6.1f} TF/s | "
                      f"_grouped_mm {base:7.3f} ms {row['grouped_mm_tflops']:6.1f} TF/s | dense "
                      f"{row['dense_tflops']:6.1f} TF/s | x{row['speedup']:.3f}", flush=True)
            if proj == "down F->H" and (only is None or "row_scale" in only):
                rows.append(bench_row_scale(name, G, epn, n, x, w_home, w_slot, w_all, cu, P, group_gemm_row_scale))
            for epi in ("registers", "smem"):  # swiglu_bwd, swiglu_bwd_smem: its shared-memory epilogue
                op = "swiglu_bwd" if epi == "registers" else "swiglu_bwd_smem"
                if proj == "down F->H" and (only is None or op in only):
                    rows.append(bench_swiglu_bwd(name, G, n, dy, w_home, w_slot, w_all, cu, P, group_gemm_swiglu_bwd,
                                                 epi))
        if only is None or only & {"swiglu", "swiglu_h"}:
            rows.extend(bench_swiglu(name, G, epn, n, H, F, cu, P, group_gemm_swiglu, only))
        if only is None or "swiglu_gather" in only:
            rows.extend(bench_swiglu_gather(name, G, epn, n, H, F, cu, P, group_gemm_swiglu, group_gemm_swiglu_gather))
        if only is None or "wgrad_gather" in only:
            rows.extend(bench_wgrad_gather(name, G, epn, n, H, F, cu, P, group_gemm_wgrad, group_gemm_wgrad_gather))
        if only is None or "swiglu_bwd_gather" in only:
            rows.extend(bench_swiglu_bwd_gather(name, G, epn, n, H, F, cu, P, group_gemm_swiglu_bwd,
                                                group_gemm_swiglu_bwd_gather))
        if only is None or "wgrad_gather_b" in only:
            rows.extend(bench_wgrad_gather_b(name, G, epn, n, H, F, cu, P, group_gemm_wgrad, group_gemm_wgrad_gather_b))
    fname = "bench_gemm.json" if only is None else "bench_gemm_fused.json"
    path = write_json(fname, dict(run_info(), results=rows), args.out)
    print("wrote", path)


def _report(row):
    print(f"{row['case']:42s} {row['proj']:13s} {row['op']:9s} ours {row['ours_ms']:7.3f} ms "
          f"{row['ours_tflops']:6.1f} TF/s | baseline {row['baseline_ms']:7.3f} ms {row['baseline_tflops']:6.1f} TF/s "
          f"({row['baseline']}) | x{row['speedup']:.3f}" + ("" if row["matches_baseline"] else "  MISMATCH"),
          flush=True)
    return row


def bench_row_scale(name, G, epn, n, h, wd_home, wd_slot, wd_all, cu, P, group_gemm_row_scale):
    """Down projection with the route weights: the fp32 per-row scale in our epilogue vs a separate pass."""
    row_w = torch.rand(n, device="cuda")
    out = torch.empty(n, wd_home.shape[2], device="cuda", dtype=torch.bfloat16)
    ours_fn = lambda: group_gemm_row_scale(h, wd_home, wd_slot, cu, row_w, pad=P, out=out)  # noqa: E731
    base_fn = lambda: torch._grouped_mm(h, wd_all, offs=cu).mul_(row_w[:, None])  # noqa: E731
    ours_fn()
    ref = base_fn()
    err = (out.float() - ref.float()).abs().max().item()
    ok = torch.allclose(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
    ours, base = cuda_time_ms(ours_fn), cuda_time_ms(base_fn)
    flops = 2.0 * n * h.shape[1] * wd_home.shape[2]
    return _report(dict(case=name, proj="down F->H", op="row_scale", groups=G, rows=n, kd=h.shape[1],
                        nd=wd_home.shape[2], ours_ms=ours, baseline_ms=base, baseline="_grouped_mm + mul_(row_w)",
                        ours_tflops=flops / ours / 1e9, baseline_tflops=flops / base / 1e9, speedup=base / ours,
                        matches_baseline=ok, max_abs_err=err))


def bench_swiglu_bwd(name, G, n, g_y, wd_home, wd_slot, wd_all, cu, P, group_gemm_swiglu_bwd, epilogue):
    """Down-projection dgrad with the SwiGLU backward epilogue (``epilogue``: "registers" or "smem") vs
    _grouped_mm dgrad + eager elementwise."""
    F = wd_home.shape[1]
    gate = torch.randn(n, F, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(n, F, device="cuda", dtype=torch.bfloat16)
    row_w = torch.rand(n, device="cuda")
    wd_t = wd_all.transpose(-1, -2)
    ours_fn = lambda: group_gemm_swiglu_bwd(g_y, wd_home, wd_slot, cu, row_w, gate, up, pad=P,  # noqa: E731
                                            epilogue=epilogue)

    def base_fn():
        d = torch._grouped_mm(g_y, wd_t, offs=cu).float()
        gf, uf = gate.float(), up.float()
        s = torch.sigmoid(gf)
        h = gf * s * uf
        gh = d * row_w[:, None]
        return ((gh * uf * s * (1 + gf * (1 - s))).bfloat16(), (gh * gf * s).bfloat16(),
                (h * row_w[:, None]).bfloat16(), (d * h).sum(1))

    got, ref = ours_fn(), base_fn()
    errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(got, ref)]
    ok = all(torch.allclose(a.float(), b.float(), atol=5e-2 * (F ** 0.5 if i == 3 else 1), rtol=5e-2)
             for i, (a, b) in enumerate(zip(got, ref)))
    ours, base = cuda_time_ms(ours_fn), cuda_time_ms(base_fn)
    flops = 2.0 * n * g_y.shape[1] * F
    op = "swiglu_bwd" if epilogue == "registers" else "swiglu_bwd_smem"
    return _report(dict(case=name, proj="down F->H", op=op, groups=G, rows=n, kd=F, nd=g_y.shape[1],
                        ours_ms=ours, baseline_ms=base, baseline="_grouped_mm dgrad + eager SwiGLU backward",
                        ours_tflops=flops / ours / 1e9, baseline_tflops=flops / base / 1e9, speedup=base / ours,
                        matches_baseline=ok, max_abs_err=max(errs)))


def bench_swiglu(name, G, epn, n, H, F, cu, P, group_gemm_swiglu, only):
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    wg = torch.randn(G, H, F, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    wu = torch.randn(G, H, F, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    wg_home, wg_slot, wu_home, wu_slot = wg[:epn], wg[epn:], wu[:epn], wu[epn:]
    w_cat = torch.cat([wg, wu], dim=2)  # [G, H, 2F]: the stronger baseline, one GEMM for both
    bufs = [torch.empty(n, F, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    silu = torch.nn.functional.silu

    def pair():
        return silu(torch._grouped_mm(x, wg, offs=cu)) * torch._grouped_mm(x, wu, offs=cu)

    def cat2f():
        gu = torch._grouped_mm(x, w_cat, offs=cu)
        return silu(gu[:, :F]) * gu[:, F:]

    flops = 2.0 * n * H * 2 * F
    rows = []
    for op, store in (("swiglu", True), ("swiglu_h", False)):
        if only is not None and op not in only:
            continue
        ours_fn = lambda s=store: group_gemm_swiglu(x, wg_home, wg_slot, wu_home, wu_slot, cu, pad=P,  # noqa: E731
                                                    store_preact=s, out=bufs[0], gate_out=bufs[1], up_out=bufs[2])
        ours_fn()
        ref = pair()
        err = (bufs[0].float() - ref.float()).abs().max().item()
        ok = torch.allclose(bufs[0].float(), ref.float(), atol=5e-2, rtol=5e-2)
        ours = cuda_time_ms(ours_fn)
        for base_name, base_fn in (("_grouped_mm gate + up + silu*up", pair), ("_grouped_mm [H, 2F] + silu*up", cat2f)):
            base = cuda_time_ms(base_fn)
            rows.append(_report(dict(case=name, proj="gate/up H->F", op=op, groups=G, rows=n, kd=H, nd=F,
                                     ours_ms=ours, baseline_ms=base, baseline=base_name,
                                     ours_tflops=flops / ours / 1e9, baseline_tflops=flops / base / 1e9,
                                     speedup=base / ours, matches_baseline=ok, max_abs_err=err)))
    return rows


def bench_swiglu_gather(name, G, epn, n, H, F, cu, P, group_gemm_swiglu, group_gemm_swiglu_gather, tokens=8192):
    """The gathered-A SwiGLU forward: its rows x[row_src] of ``tokens`` tokens (random, every row routed),
    against the plain kernel on the pre-gathered rows (same outputs, bitwise) and against the copy
    plus the plain kernel (what the layer does without the gather)."""
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    row_src = torch.randint(0, tokens, (n,), device="cuda", dtype=torch.int32)
    rows_g = x[row_src.long()]
    wg = torch.randn(G, H, F, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    wu = torch.randn(G, H, F, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    weights = (wg[:epn], wg[epn:], wu[:epn], wu[epn:])
    bufs = [torch.empty(n, F, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ref_bufs = [torch.empty(n, F, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    outs = dict(out=bufs[0], gate_out=bufs[1], up_out=bufs[2])
    ref_outs = dict(out=ref_bufs[0], gate_out=ref_bufs[1], up_out=ref_bufs[2])
    ours_fn = lambda: group_gemm_swiglu_gather(x, row_src, *weights, cu, pad=P, **outs)  # noqa: E731
    plain_fn = lambda: group_gemm_swiglu(rows_g, *weights, cu, pad=P, **ref_outs)  # noqa: E731

    def copy_and_plain():
        torch.index_select(x, 0, row_src, out=rows_g)
        plain_fn()

    ours_fn()
    plain_fn()
    ok = all(torch.equal(a, b) for a, b in zip(bufs, ref_bufs))
    return _gathered_rows(dict(case=name, proj="gate/up H->F", op="swiglu_gather", groups=G, rows=n, kd=H, nd=F),
                          ok, 2.0 * n * H * 2 * F, ours_fn, plain_fn, copy_and_plain, "group_gemm_swiglu", "x")


def _gathered_rows(row, ok, flops, ours_fn, plain_fn, copy_and_plain, plain_name, src_name):
    """The rows of one gathered kernel's benchmark (``row``: case, op, sizes): ``ours_fn`` timed against the
    plain kernel ``plain_name`` on the pre-gathered rows (``plain_fn``) and against the gather copy plus
    that kernel (``copy_and_plain``); ``ok``: the outputs were bitwise equal."""
    if not ok:
        print(f"MISMATCH {row['case']} {row['op']}: not bitwise equal to {plain_name} on {src_name}[row_src]",
              flush=True)
    ours = cuda_time_ms(ours_fn)
    rows = []
    for base_name, base_fn in ((f"{plain_name} on {src_name}[row_src]", plain_fn),
                               (f"index_select + {plain_name}", copy_and_plain)):
        base = cuda_time_ms(base_fn)
        rows.append(_report(dict(row, ours_ms=ours, baseline_ms=base, baseline=base_name,
                                 ours_tflops=flops / ours / 1e9, baseline_tflops=flops / base / 1e9,
                                 speedup=base / ours, matches_baseline=ok, max_abs_err=0.0 if ok else float("nan"))))
    return rows


def bench_wgrad_gather(name, G, epn, n, H, F, cu, P, group_gemm_wgrad, group_gemm_wgrad_gather, tokens=8192):
    """The gathered-A wgrad of the gate/up projection (dW_g = x[row_src]_g^T dy_g, [H, F] per group): its
    rows of ``tokens`` tokens (random, every row routed), against the plain kernel on the pre-gathered
    rows (same gradients, bitwise) and against the copy plus the plain kernel. Home groups written bf16,
    slot groups accumulated into fp32 (zeroed before the correctness call; the timed calls keep adding)."""
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    row_src = torch.randint(0, tokens, (n,), device="cuda", dtype=torch.int32)
    rows_g = x[row_src.long()]
    dy = torch.randn(n, F, device="cuda", dtype=torch.bfloat16)
    dw_home, ref_home = (torch.empty(epn, H, F, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dw_slot, ref_slot = (torch.zeros(G - epn, H, F, device="cuda") for _ in range(2))
    ours_fn = lambda: group_gemm_wgrad_gather(x, row_src, dy, cu, dw_home, dw_slot, pad=P)  # noqa: E731
    plain_fn = lambda: group_gemm_wgrad(rows_g, dy, cu, ref_home, ref_slot, pad=P)  # noqa: E731

    def copy_and_plain():
        torch.index_select(x, 0, row_src, out=rows_g)
        plain_fn()

    ours_fn()
    plain_fn()
    ok = torch.equal(dw_home, ref_home) and torch.equal(dw_slot, ref_slot)
    return _gathered_rows(dict(case=name, proj="gate/up H->F", op="wgrad_gather", groups=G, rows=n, kd=H, nd=F),
                          ok, 2.0 * n * H * F, ours_fn, plain_fn, copy_and_plain, "group_gemm_wgrad", "x")


def bench_swiglu_bwd_gather(name, G, epn, n, H, F, cu, P, group_gemm_swiglu_bwd, group_gemm_swiglu_bwd_gather,
                            tokens=8192):
    """The SwiGLU-backward dgrad with g_y = g_out[row_src] gathered in the kernel (``tokens`` tokens, random,
    every row routed), against the plain kernel (shared-memory epilogue) on the pre-gathered g_y (same
    outputs, bitwise) and against the copy plus the plain kernel (what combine's backward does at R = 1)."""
    g_out = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    row_src = torch.randint(0, tokens, (n,), device="cuda", dtype=torch.int32)
    g_y = g_out[row_src.long()]
    wd = torch.randn(G, F, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    gate, up = (torch.randn(n, F, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rest = (wd[:epn], wd[epn:], cu, torch.rand(n, device="cuda"), gate, up)
    ours_fn = lambda: group_gemm_swiglu_bwd_gather(g_out, row_src, *rest, pad=P)  # noqa: E731
    plain_fn = lambda: group_gemm_swiglu_bwd(g_y, *rest, pad=P)  # noqa: E731

    def copy_and_plain():
        torch.index_select(g_out, 0, row_src, out=g_y)
        return plain_fn()

    ok = all(torch.equal(a, b) for a, b in zip(ours_fn(), plain_fn()))
    return _gathered_rows(dict(case=name, proj="down F->H", op="swiglu_bwd_gather", groups=G, rows=n, kd=F, nd=H),
                          ok, 2.0 * n * H * F, ours_fn, plain_fn, copy_and_plain, "group_gemm_swiglu_bwd", "g_out")


def bench_wgrad_gather_b(name, G, epn, n, H, F, cu, P, group_gemm_wgrad, group_gemm_wgrad_gather_b, tokens=8192):
    """The down projection's wgrad (dW_g = h_w_g^T g_y_g, [F, H] per group) with g_y = g_out[row_src] gathered
    in the kernel (``tokens`` tokens, random, every row routed), against the plain kernel on the pre-gathered
    g_y (same gradients, bitwise) and against the copy plus the plain kernel. Home groups written bf16, slot
    groups accumulated into fp32 (zeroed before the correctness call; the timed calls keep adding)."""
    g_out = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    row_src = torch.randint(0, tokens, (n,), device="cuda", dtype=torch.int32)
    g_y = g_out[row_src.long()]
    h_w = torch.randn(n, F, device="cuda", dtype=torch.bfloat16)
    dw_home, ref_home = (torch.empty(epn, F, H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dw_slot, ref_slot = (torch.zeros(G - epn, F, H, device="cuda") for _ in range(2))
    ours_fn = lambda: group_gemm_wgrad_gather_b(h_w, g_out, row_src, cu, dw_home, dw_slot, pad=P)  # noqa: E731
    plain_fn = lambda: group_gemm_wgrad(h_w, g_y, cu, ref_home, ref_slot, pad=P)  # noqa: E731

    def copy_and_plain():
        torch.index_select(g_out, 0, row_src, out=g_y)
        plain_fn()

    ours_fn()
    plain_fn()
    ok = torch.equal(dw_home, ref_home) and torch.equal(dw_slot, ref_slot)
    return _gathered_rows(dict(case=name, proj="down F->H", op="wgrad_gather_b", groups=G, rows=n, kd=F, nd=H),
                          ok, 2.0 * n * H * F, ours_fn, plain_fn, copy_and_plain, "group_gemm_wgrad", "g_out")


if __name__ == "__main__":
    main()
