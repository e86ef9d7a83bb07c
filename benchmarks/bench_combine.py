"""Launch sweep of the one-rank combine (combine_local: csrc_cute/combine.py's pull kernel, LOCAL) at the layer
shape, 1 GPU: per CTA count x (threads per CTA, U 16-byte chunks per lane per segment, NB rows read at once).

    python benchmarks/bench_combine.py [--out DIR] [--S 8192 --H 7168 --K 8 --epn 48 --P 128]
                                       [--ctas 132,264,528,1056] [--variants 512:8:4,512:4:4,...]
                                       [--peer] [--after-gemm-ms 20]
    python benchmarks/bench_combine.py --smoke [--out DIR]   (CPU: compiles each variant for sm_90a, no timing)

Why: at R = 1 the layer's combine is this one kernel, a pure memory stream (every routed row read once, out[s]
written once); its launch shape is combine.py's _NT_PULL, _U_LOCAL, _NB_LOCAL and the layer's 2 x SMs CTAs. Swept
first in session 31 (the then default, 8 chunks x 4 rows, had only ~5 16-byte loads a thread outstanding: ptxas
interleaved them with the adds), then in session 50 against SonicMoE's kernel, which led to 2 chunks x 8 rows.

Inputs: rows [NvS, H] bf16 random (NvS as the layer's, S*K + (P-1)*epn rounded up to P); a one-rank plan,
each token's K entries at distinct random rows (dst_rank 0, dst_row a slice of a random permutation,
primary_row = dst_row). Each variant is compiled through combine's `_compile_pull` with the arguments
`combine_local` passes plus its (nt, u, nb), and must give the default variant's output bit for bit, on this
plan and on one with about a third of the entries absent (dst_rank -1: the NB/2, ..., 1 row tails run);
the default must equal torch's fp32 sum in k order (a failed check is printed, the run exits non-zero after
writing its results, and a variant that differs is not timed). Then the others are timed round-robin (CUDA events,
each round --warmup calls then --iters back to back, median of --repeats rounds). Bytes: every routed row
read once, out written once, the plan's three int32 tables read (common.combine_pull_bytes); the copy
roof is a device-to-device copy measured in the same run (read + write counted).
--peer: SonicMoE's one-rank combine (`token_gather_and_sum_varlen_K_triton`, the kernel its MoE runs in forward and
backward; Triton, autotuned on its first call) on the same rows and plan, in the same rounds (with peers.sh on
the device; its sum is a tree over k, so it is checked against torch's within one bf16 ulp of the row, not bit for bit).
--after-gemm-ms G: each timed round of a variant first keeps the GPU busy with bf16 matmuls for about G ms, then
times --iters calls: meant as the layer's clock and power state, where the combine runs between GEMMs at the board's
power cap (the 8-chunk x 4-row launch, the default before session 50, took 0.403-0.408 ms a pass in H100 layer steps
against 0.373 alone). It did not reproduce that: on an H100 every variant's time moved less than 1% with it
(results/bench_combine_session50_h100_after_gemm.json), so the layer's own step (bench_peers) decides.
Writes bench_combine.json (and a PNG with matplotlib).
--smoke: no GPU; each (nt, u, nb) compiled for sm_90a at the layer shape in compile_check's child, with
ptxas' registers and spill bytes per variant (what decides which variants the sweep keeps).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_comm import copy_roof_gbs  # noqa: E402
from benchmarks.common import (apply_smoke_defaults, combine_pull_bytes, cuda_time_ms, events_ms,  # noqa: E402
                               run_info, time_round_robin, write_json)
from csrc_cute.combine import _NB_LOCAL, _NT_PULL, _U_LOCAL, _compile_pull  # noqa: E402
from csrc_cute.dispatch import align_up  # noqa: E402

DEFAULT = (_NT_PULL, _U_LOCAL, _NB_LOCAL)  # what combine_local launches
LAUNCH_KEYS = ("ctas", "nt", "u", "nb")  # a variant's launch, as a result row names it
PEER = "sonicmoe"  # the results' name of the peer's kernel (its LAUNCH_KEYS: None)
# (nt, u, nb) that compile without spills at the layer shape (sm_90a, ptxas 13.0; `--smoke` reports them):
# U = 16 spills at 512 threads, so it is left out
VARIANTS = "512:2:8,512:8:4,512:4:8,512:1:8,256:2:8,256:8:4"
CTAS = "132,264,528,1056"
SMOKE = dict(ctas="264")


def variant_list(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item]


def one_rank_plan(S: int, K: int, nvs: int, gen: torch.Generator, absent: float = 0.0):
    """(dst_rank, dst_row, primary_row) int32 [S, K]: every entry on rank 0 at a distinct random row of nvs, a
    fraction `absent` of the entries marked absent (dst_rank -1)."""
    dst_row = torch.randperm(nvs, generator=gen)[:S * K].view(S, K).int()
    dst_rank = torch.zeros(S, K, dtype=torch.int32)
    dst_rank[torch.rand(S, K, generator=gen) < absent] = -1
    return dst_rank, dst_row, dst_row.clone()


def reference(rows: torch.Tensor, dst_rank: torch.Tensor, dst_row: torch.Tensor) -> torch.Tensor:
    """combine_local's result in torch: per token the fp32 sum, in k order, of its present rows, rounded once."""
    acc = torch.zeros(dst_row.shape[0], rows.shape[1], dtype=torch.float32, device=rows.device)
    for k in range(dst_row.shape[1]):
        acc += torch.where((dst_rank[:, k] == 0)[:, None], rows[dst_row[:, k].long()].float(), 0.0)
    return acc.to(rows.dtype)


def peer_inputs(plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(M_perm [S*K], M_offset [S+1]) int32 of SonicMoE's token_gather_and_sum for a one-rank plan whose entries are
    all present: token s sums rows M_perm[M_offset[s]:M_offset[s+1]], its K rows in k order."""
    dst_rank, dst_row = plan[0], plan[1]
    if bool((dst_rank != 0).any()):
        raise ValueError("peer_inputs: the peer's kernel takes no absent entries (dst_rank must be 0 everywhere)")
    S, K = dst_row.shape
    return (dst_row.reshape(-1).int().contiguous(),
            torch.arange(0, S * K + 1, K, dtype=torch.int32, device=dst_row.device))


def peer_launcher(rows, plan, out):
    """One call of SonicMoE's one-rank combine on `plan` (unweighted: our rows carry their route weight already)."""
    from sonicmoe.functional.reduction_over_k_gather import token_gather_and_sum_varlen_K_triton

    S, K = plan[1].shape
    m_perm, m_offset = peer_inputs(plan)
    return lambda: token_gather_and_sum_varlen_K_triton(rows, None, out, m_perm, m_offset, S, K, rows.shape[1], False)


def within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether bf16 `got` is within one bf16 ulp of `want` everywhere (a sum in another order rounds once too).
    The bound is sqrt(2) x eps x |want|: eps x |want| is at least the ulp of `want`'s binade, and the sqrt(2) is
    slack for the two fp32 sums differing before either is rounded (the tree's partial sums round elsewhere than
    the k chain's)."""
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return bool(((got.float() - want.float()).abs() <= ulp * 2 ** 0.5).all())


def matmul_heater(ms: float):
    """A call that keeps the GPU in bf16 matmuls for about `ms` ms (no sync): 8192^3 products back to back."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    one = cuda_time_ms(lambda: a @ b, iters=5, repeats=3, warmup=2)
    n = max(1, round(ms / one))

    def heat():
        for _ in range(n):
            a @ b
    return heat


def after_heat_ms(call, heat, iters: int, warmup: int) -> float:
    """Mean time of `iters` calls launched right after `heat()` (CUDA events around the calls only)."""
    for _ in range(warmup):
        call()
    heat()
    return events_ms(call, iters)


def launcher(rows, plan, out, status, ncta: int, nt: int, u: int, nb: int):
    """One launch of the (ncta, nt, u, nb) variant on `plan`, as combine_local launches its kernel."""
    S, K = plan[0].shape
    fn = _compile_pull(S, rows.shape[1], K, 1, rows.shape[0], rows.dtype, ncta, local=True, nt=nt, u=u, nb=nb)
    flat = [t.view(-1) for t in plan]
    return lambda: fn(rows.view(-1), *flat, out.view(-1), status)


def run(opts) -> dict:
    torch.cuda.set_device(0)
    S, H, K = opts.S, opts.H, opts.K
    nvs = align_up(S * K + (opts.P - 1) * opts.epn, opts.P)
    rows = torch.randn(nvs, H, device="cuda", dtype=torch.bfloat16,
                       generator=torch.Generator(device="cuda").manual_seed(opts.seed))
    gen = torch.Generator().manual_seed(opts.seed)
    plans = {name: tuple(t.cuda() for t in one_rank_plan(S, K, nvs, gen, absent))
             for name, absent in (("full", 0.0), ("ragged", 1 / 3))}
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(S, H, dtype=torch.bfloat16, device="cuda")
    layer_ctas = 2 * torch.cuda.get_device_properties(0).multi_processor_count  # EPGroup's comm_sms at R = 1
    grid = [(c, *v) for c in opts.ctas for v in opts.variants]
    base = (layer_ctas, *DEFAULT)
    refs = {name: reference(rows, *plan[:2]) for name, plan in plans.items()}
    checks, differ = {}, set()
    for name, plan in plans.items():
        launcher(rows, plan, out, status, *base)()
        want = out.clone()
        checks[f"{name}: default == torch"] = torch.equal(want, refs[name])
        for cfg in grid:
            out.fill_(float("nan"))
            launcher(rows, plan, out, status, *cfg)()
            checks[f"{name}: {cfg} == default"] = same = torch.equal(out.view(torch.int16), want.view(torch.int16))
            if not same:
                differ.add(cfg)
    checks["status word 0"] = int(status.item()) == 0
    calls = {cfg: launcher(rows, plans["full"], out, status, *cfg) for cfg in grid if cfg not in differ}
    if opts.peer:
        peer_out = torch.empty_like(out)
        peer = peer_launcher(rows, plans["full"], peer_out)
        peer()  # Triton's autotuning runs here, on the same rows
        checks[f"full: {PEER} within 1 ulp of torch"] = ok = within_one_ulp(peer_out, refs["full"])
        if ok:
            calls[PEER] = peer
    print(f"checked {len(grid)} variants against the default on {len(plans)} plans: {len(differ)} differ from it "
          "(those are not timed)", flush=True)
    for k in (k for k, ok in checks.items() if not ok):
        print(f"FAIL {k}", flush=True)
    if opts.after_gemm_ms > 0:
        heat = matmul_heater(opts.after_gemm_ms)
        timed = time_round_robin(calls, lambda c: after_heat_ms(c, heat, opts.iters, opts.warmup), opts.repeats)
    else:
        timed = time_round_robin(calls, lambda c: cuda_time_ms(c, iters=opts.iters, repeats=1, warmup=opts.warmup),
                                 opts.repeats)
    roof = copy_roof_gbs()
    nbytes = combine_pull_bytes(S * K, S, S * K, H * rows.element_size())
    base_ms = timed.get(base)
    results = [dict(impl=PEER if cfg == PEER else "ours",
                    **(dict.fromkeys(LAUNCH_KEYS) if cfg == PEER else dict(zip(LAUNCH_KEYS, cfg))), ms=ms,
                    gbs=nbytes / ms / 1e6, of_copy_roof=nbytes / ms / 1e6 / roof,
                    speedup_vs_layer_default=base_ms / ms if base_ms else None)
               for cfg, ms in timed.items()]
    return dict(run_info(), S=S, H=H, K=K, epn=opts.epn, P=opts.P, nvs=nvs, dtype="bfloat16", bytes=nbytes,
                layer_default=dict(zip(LAUNCH_KEYS, base)), copy_roof_gbs=roof, iters=opts.iters,
                repeats=opts.repeats, warmup=opts.warmup, after_gemm_ms=opts.after_gemm_ms, checks=checks,
                all_checks_ok=all(checks.values()), smoke=False, results=results)


def compile_variant(S: int, H: int, K: int, nvs: int, ncta: int, nt: int, u: int, nb: int) -> None:
    """One variant compiled (in compile_check's child: for its arch, without a driver to load it)."""
    from csrc_cute.compile_check import expect_no_driver

    with expect_no_driver():
        _compile_pull(S, H, K, 1, nvs, torch.bfloat16, ncta, local=True, nt=nt, u=u, nb=nb)


def smoke(opts) -> dict:
    """--smoke: ptxas' registers and spill bytes of each variant, compiled for sm_90a without a GPU."""
    from csrc_cute.compile_check import run_compile_check

    nvs = align_up(opts.S * opts.K + (opts.P - 1) * opts.epn, opts.P)
    results = []
    for ncta in opts.ctas:
        for nt, u, nb in opts.variants:
            with tempfile.TemporaryDirectory() as tmp:
                res = run_compile_check("benchmarks.bench_combine:compile_variant", tmp, kwargs=dict(
                    S=opts.S, H=opts.H, K=opts.K, nvs=nvs, ncta=ncta, nt=nt, u=u, nb=nb))
            (st,) = res.stats
            results.append(dict(ctas=ncta, nt=nt, u=u, nb=nb, registers=st.registers, spill_bytes=st.spill_bytes,
                                stack_bytes=st.stack_frame_bytes))
            print(f"{ncta:5d} {nt:4d} {u:2d} {nb:2d}  {st.registers:4d} registers  {st.spill_bytes:5d} B spilled",
                  flush=True)
    return dict(run_info(), S=opts.S, H=opts.H, K=opts.K, epn=opts.epn, P=opts.P, nvs=nvs, dtype="bfloat16",
                arch="sm_90a", smoke=True, device="cpu", results=results)


def row_label(r: dict) -> str:
    """A result row's name: the peer's, or threads per CTA / U / NB of ours."""
    return r["impl"] if r.get("impl", "ours") != "ours" else f"{r['nt']}/{r['u']}/{r['nb']}"


def print_table(payload: dict) -> None:
    after = payload.get("after_gemm_ms") or 0
    print(f"combine_local S={payload['S']} H={payload['H']} K={payload['K']} NvS={payload['nvs']}: "
          f"{payload['bytes'] / 1e9:.3f} GB a call; copy roof {payload['copy_roof_gbs']:.0f} GB/s; "
          f"layer default {tuple(payload['layer_default'].values())}"
          + (f"; each timed after {after:g} ms of matmuls" if after else ""))
    print(f"{'ctas':>5} {'nt/u/nb':>10} | {'ms':>7} {'GB/s':>6} {'roof':>5} {'x dflt':>6}")
    for r in payload["results"]:
        x = "" if r["speedup_vs_layer_default"] is None else f"{r['speedup_vs_layer_default']:6.3f}"
        print(f"{r['ctas'] or '':>5} {row_label(r):>10} | {r['ms']:7.4f} {r['gbs']:6.0f} "
              f"{100 * r['of_copy_roof']:4.1f}% {x}")
    if payload["results"]:
        best = min(payload["results"], key=lambda r: r["ms"])
        print(f"fastest: {best['ctas'] or ''} {row_label(best)} {best['ms']:.4f} ms")
    print(f"checks {'all ok' if payload['all_checks_ok'] else 'FAILED'}")


def plot(payload: dict, path: str) -> None:
    """GB/s per (nt, u, nb), one bar per CTA count (none for a variant that was not timed)."""
    from benchmarks.plot_results import bars, caption  # (sets matplotlib's Agg backend)
    import matplotlib.pyplot as plt

    res = payload["results"]
    labels = list(dict.fromkeys(row_label(r) for r in res))
    gbs = {(r["ctas"], row_label(r)): r["gbs"] for r in res}
    series = {f"{c} CTAs" if c else "peer": [gbs.get((c, lab), 0.0) for lab in labels]
              for c in dict.fromkeys(r["ctas"] for r in res)}
    fig, ax = plt.subplots(figsize=(max(7, len(labels) * 1.2), 4))
    bars(ax, labels, series, "GB/s (rows in + out)")
    ax.axhline(payload["copy_roof_gbs"], color="k", ls="--", lw=0.8, label="copy roof")
    ax.legend(fontsize=8)
    ax.set_xlabel("threads per CTA / U / NB")
    after = f", each timed after {payload['after_gemm_ms']:g} ms of matmuls" if payload.get("after_gemm_ms") else ""
    ax.set_title(f"combine_local S={payload['S']} H={payload['H']} K={payload['K']}{after}\n" + caption(payload),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="result dir (default benchmarks/results; smoke: a temp dir)")
    for k, v in dict(S=8192, H=7168, K=8, epn=48, P=128, seed=0).items():
        ap.add_argument(f"--{k}", dest=k, type=int, default=v)
    ap.add_argument("--ctas", default=CTAS, help="comma-separated CTA counts")
    ap.add_argument("--variants", default=VARIANTS, help="comma-separated nt:u:nb")
    ap.add_argument("--iters", type=int, default=50, help="calls per timed round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (median), each timing every variant once")
    ap.add_argument("--warmup", type=int, default=5, help="calls before each timed round")
    ap.add_argument("--peer", action="store_true", help="time SonicMoE's one-rank combine in the same rounds")
    ap.add_argument("--after-gemm-ms", dest="after_gemm_ms", type=float, default=0.0,
                    help="time each round's calls right after this many ms of bf16 matmuls (the layer's clock state)")
    ap.add_argument("--smoke", action="store_true", help="CPU: compile each variant for sm_90a, ptxas statistics")
    opts = ap.parse_args(argv)
    if opts.smoke:
        apply_smoke_defaults(opts, argv, SMOKE)
    opts.ctas = [int(c) for c in opts.ctas.split(",") if c]
    opts.variants = variant_list(opts.variants)
    if opts.smoke:
        payload = smoke(opts)
        out_dir = opts.out or tempfile.mkdtemp(prefix="bench_combine_smoke_")  # smoke figures are no results
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_combine: no CUDA device (use --smoke for the CPU check)")
        payload = run(opts)
        print_table(payload)
        out_dir = opts.out
    path = write_json("bench_combine.json", payload, out_dir)
    print(f"wrote {path}")
    if not opts.smoke:
        try:
            plot(payload, path[:-len(".json")] + ".png")
        except ImportError:
            print("matplotlib missing: no PNG")
        if not payload["all_checks_ok"]:
            raise SystemExit("bench_combine: a variant's output differs (see FAIL above)")


if __name__ == "__main__":
    main()
