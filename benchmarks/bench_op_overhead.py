"""What the cross-rank agreement costs per op (issue 15): host cost per op, the GPU cost of the barrier the
op-id check rides on, host syncs, and the CPU reference's agreement exchange.

    python benchmarks/bench_op_overhead.py [--out DIR] [--shapes tiny,design]   (one GPU: parts 1-4)
    python benchmarks/bench_op_overhead.py --smoke [--out DIR]                   (CPU only: part 4)

1. host     at R = 1 on one GPU (an EPGroup with its own 1-rank group), per public moonep op of a MoE
            forward and backward, and per whole moe_experts forward / forward+backward: the CPU time per
            call of `calls` calls enqueued back to back with no sync (each repeat starts on an idle GPU;
            `calls` is cut so that at most QUEUE_ITEMS GPU work items are pending: the host never waits for
            queue room). The raw launches beside them: the barrier's Python wrapper (csrc_cute.sync.barrier),
            its compiled launcher called directly, an empty CuTe DSL kernel, one aten op. GPU time per call
            (CUDA events) and GPU work items per call (profiler) in the same rows.
2. barrier  GPU time per launch of the barrier kernel at R = 1, of the same barrier compiled without the
            op-id check (sync's "barrier_unchecked", which no op runs) and of an empty kernel with the
            barrier's arguments and launch shape (benchmarks/empty_kernel.py): back to back on a stream, and
            replayed from one CUDA graph of `launches` launches (no launch gaps). barrier - unchecked is what
            the op-id check costs, barrier - empty what the whole barrier costs; dispatch, combine,
            gather_row_weights (and prefetch_weights, reduce_grad at R > 1) run 2 barriers, plan 1 (in its
            count exchange).
3. syncs    every row of part 1 once under torch.cuda.set_sync_debug_mode("error") and once under the
            profiler (host sync calls, synchronous cudaMemcpy, DtoH copies: benchmarks.common.profile_step).
4. agreement  CPU reference ops (gloo, spawned ranks) at R = 1 and R = 2, per call: the full op; the op
            with the exchange bypassed (moonep_ops.ops' `agree` swapped for its argument checks alone);
            `agree` alone. exchange_us = full - bypassed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_comm import graph_time_ms  # noqa: E402
from benchmarks.common import (apply_smoke_defaults, cuda_time_ms, names_option, profile_step,  # noqa: E402
                               run_info, run_without_host_sync, short_error, write_json)
from moonep_ops.handles import Dispatch, Plan  # noqa: E402

ops = torch.ops.moonep
SHAPES = dict(tiny=dict(S=64, H=256, K=2, E=8, F=128), design=dict(S=8192, H=7168, K=8, E=48, F=2048))
CPU_SHAPE = dict(S=64, H=256, K=2, E=8, F=64)
QUEUE_ITEMS = 512  # pending GPU work items: well below the ~1024 launches CUDA queues before a launch blocks
SMOKE = dict(cpu_calls=10, repeats=3)


def per_call_us(fn, calls: int, repeats: int, settle=lambda: None) -> float:
    """Median over repeats of the wall time per call of `calls` back-to-back calls, in us; settle() (a
    device sync) before each repeat and after the last, outside the timed span."""
    fn()
    times = []
    for _ in range(repeats):
        settle()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    settle()
    return _median(times)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


# ------------------------------------------------------------------------------- GPU, R = 1 (parts 1-3)
def gpu_inputs(ep, experts) -> dict:
    c, dev = ep.cfg, ep.device
    x = (torch.randn(c.S, c.H, device=dev) / 4).to(torch.bfloat16)
    ids = torch.rand(c.S, c.E, device=dev).topk(c.K, dim=1).indices
    route_w = torch.softmax(torch.randn(c.S, c.K, device=dev), 1)
    p = Plan(*ops.plan(ids, c.E, c.B, c.P, c.R, ep.ctrl, ep.group_name))
    d = Dispatch(*ops.dispatch(x, route_w, p.dst_rank, p.dst_row, p.primary_row, p.cu_seqlens, p.group_rows,
                               *ep.dispatch_buffers, ep.ctrl, ep.group_name))
    w = tuple(t.detach() for t in (experts.w_gate, experts.w_up, experts.w_down))
    h, gate, up = ops.group_gemm_swiglu(d.rows, w[0], ep.pools[0], w[1], ep.pools[1], p.cu_seqlens, c.P, True,
                                        p.experts_remote, ep.group_name)
    return dict(x=x, ids=ids, route_w=route_w, p=p, d=d, w=w, h=h, gate=gate, up=up)


def op_calls(ep, experts, a: dict) -> dict:
    """Name -> one call, for every public op of a MoE layer's forward and backward at R = 1 (raw ops:
    no autograd), and the whole layer (autograd, as training runs it)."""
    from moonep_ops import moe_experts

    c, p, d, w = ep.cfg, a["p"], a["d"], a["w"]
    pools, remote, grp = ep.pools, p.experts_remote, ep.group_name
    plan_tables = (p.dst_rank, p.dst_row, p.primary_row)
    x_req, w_req = a["x"].clone().requires_grad_(), a["route_w"].clone().requires_grad_()
    leaves = (x_req, w_req, *experts.parameters())
    g_out = torch.randn_like(a["x"])

    def layer():
        return moe_experts(ep, experts, x_req, a["ids"], w_req)[0]

    return {
        "plan": lambda: ops.plan(a["ids"], c.E, c.B, c.P, c.R, ep.ctrl, grp),
        "dispatch": lambda: ops.dispatch(a["x"], a["route_w"], *plan_tables, p.cu_seqlens, p.group_rows,
                                         *ep.dispatch_buffers, ep.ctrl, grp),
        "prefetch_weights": lambda: ops.prefetch_weights(*w, p.experts_to_copy, *pools, ep.ctrl, grp),
        "group_gemm_swiglu": lambda: ops.group_gemm_swiglu(d.rows, w[0], pools[0], w[1], pools[1], p.cu_seqlens,
                                                           c.P, True, remote, grp),
        "group_gemm_row_scale": lambda: ops.group_gemm_row_scale(a["h"], w[2], pools[2], p.cu_seqlens, d.row_w,
                                                                 c.P, remote, grp),
        "combine": lambda: ops.combine(d.rows, d.row_primary, d.row_next, *plan_tables, ep.presum, ep.ctrl, grp),
        "combine_backward": lambda: ops.combine_backward(g_out, *plan_tables, p.cu_seqlens, p.group_rows, ep.key),
        "experts_ffn_backward": lambda: ops.experts_ffn_backward(d.rows, d.rows, d.row_w, *w, p.cu_seqlens,
                                                                 p.experts_to_copy, a["gate"], a["up"], c.P, ep.key),
        "dispatch_backward": lambda: ops.dispatch_backward(d.rows, d.row_w, d.row_primary, d.row_next, *plan_tables,
                                                           ep.key),
        "moe_experts forward": layer,
        "moe_experts forward+backward": lambda: torch.autograd.grad(layer(), leaves, g_out),
    }


def launch_calls(ep) -> tuple[dict, tuple]:
    """The raw launches: the barrier's wrapper and compiled launcher, the empty kernel, an aten op; and
    the launchers' arguments."""
    from benchmarks.empty_kernel import compile_empty
    from csrc_cute import sync
    from csrc_cute.status import OP_IDS
    from moonep_ops.registry import peers

    c = ep.cfg
    peer_ctrl = peers("bench_op_overhead", "ctrl", ep.ctrl)
    args = (peer_ctrl, ep.ctrl, ep.rank, sync._timeout_ns(ep.timeout_s), OP_IDS["dispatch"])
    kernels = dict(barrier=sync._compile("barrier", c.R, c.E), unchecked=sync._compile("barrier_unchecked", c.R, c.E),
                   empty=compile_empty(c.R, c.E))
    scratch = torch.zeros(1, device=ep.device)
    return {"sync.barrier (Python wrapper)": lambda: sync.barrier(peer_ctrl, ep.ctrl, ep.rank, c.E, ep.timeout_s,
                                                                   "dispatch"),
            "barrier kernel (compiled launcher)": lambda: kernels["barrier"](*args),
            "empty kernel (compiled launcher)": lambda: kernels["empty"](*args),
            "aten zero_ (1 element)": scratch.zero_}, (kernels, args)


def sync_check(fn) -> dict:
    """Whether one call synchronised the host: torch's sync debug mode, then the profiler's count."""
    _, err = run_without_host_sync(fn)
    error = None if err is None else short_error(err)
    torch.cuda.synchronize()
    syncs, items = profile_step(fn)
    return dict(sync_debug_error=error, profiler_syncs=syncs, gpu_items=items)


def measure_row(name: str, fn, opts: dict) -> dict:
    fn()  # compiled and warm
    row = dict(op=name, **sync_check(fn))
    calls = max(2, min(opts["calls"], QUEUE_ITEMS // max(1, row["gpu_items"])))
    row.update(calls=calls, host_us=per_call_us(fn, calls, opts["repeats"], torch.cuda.synchronize),
               gpu_us=cuda_time_ms(fn, iters=calls, repeats=opts["repeats"]) * 1e3)
    row["synced"] = bool(row["sync_debug_error"] or row["profiler_syncs"])
    return row


def barrier_costs(kernels: dict, args, opts: dict) -> dict:
    """us per launch of each kernel (stream, graph); the op-id check's and the whole barrier's share."""
    n = opts["launches"]
    out = {}
    for name, kernel in kernels.items():
        def fn(kernel=kernel):
            kernel(*args)
        out[f"{name}_stream_us"] = cuda_time_ms(fn, iters=n, repeats=opts["repeats"]) * 1e3
        out[f"{name}_graph_us"] = graph_time_ms(lambda: [fn() for _ in range(n)], iters=3,
                                                repeats=opts["repeats"]) * 1e3 / n
    for mode in ("graph", "stream"):
        out[f"barrier_minus_empty_{mode}_us"] = out[f"barrier_{mode}_us"] - out[f"empty_{mode}_us"]
        out[f"op_check_{mode}_us"] = out[f"barrier_{mode}_us"] - out[f"unchecked_{mode}_us"]
    # 2 barriers per comm op; graph replay has no launch gaps, so it isolates the kernels' own time
    out["op_check_per_comm_op_us"] = 2 * out["op_check_graph_us"]
    out["barrier_per_comm_op_us"] = 2 * out["barrier_minus_empty_graph_us"]
    return out


def gpu_shape(name: str, opts: dict) -> dict:
    from moonep_ops import EPConfig, EPGroup, MoEExperts

    shape = SHAPES[name]
    ep = EPGroup(EPConfig(R=1, **shape), device="cuda")
    experts = MoEExperts(ep)
    launches, (kernels, args) = launch_calls(ep)
    rows = [measure_row(n, fn, opts) for n, fn in {**op_calls(ep, experts, gpu_inputs(ep, experts)),
                                                   **launches}.items()]
    out = dict(name=name, shape=shape, rows=rows, barrier=barrier_costs(kernels, args, opts))
    ep.check("bench_op_overhead")  # a barrier that timed out or met another op would void the figures
    ep.destroy()
    torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- CPU agreement (part 4)
def _checks_only(op, ctrl, group, check=None, shared=None):
    """`agree` without the exchange: the op's argument checks alone."""
    return check() if check is not None else None


@contextlib.contextmanager
def agreement_bypassed():
    """The CPU ops call `agree` by moonep_ops.ops' module-global name: swap in the checks alone."""
    from moonep_ops import ops as op_impl

    full = op_impl.agree
    op_impl.agree = _checks_only
    try:
        yield
    finally:
        op_impl.agree = full


def cpu_calls(ep) -> dict:
    c = ep.cfg
    gen = torch.Generator().manual_seed(ep.rank)
    x, route_w = torch.randn(c.S, c.H, generator=gen), torch.softmax(torch.randn(c.S, c.K, generator=gen), 1)
    ids = torch.rand(c.S, c.E, generator=gen).topk(c.K, dim=1).indices
    p = Plan(*ops.plan(ids, c.E, c.B, c.P, c.R, ep.ctrl, ep.group_name))
    tables = (p.dst_rank, p.dst_row, p.primary_row)
    d = Dispatch(*ops.dispatch(x, route_w, *tables, p.cu_seqlens, p.group_rows, *ep.dispatch_buffers, ep.ctrl,
                               ep.group_name))
    return {"plan": lambda: ops.plan(ids, c.E, c.B, c.P, c.R, ep.ctrl, ep.group_name),
            "dispatch": lambda: ops.dispatch(x, route_w, *tables, p.cu_seqlens, p.group_rows, *ep.dispatch_buffers,
                                             ep.ctrl, ep.group_name),
            "combine": lambda: ops.combine(d.rows, d.row_primary, d.row_next, *tables, ep.presum, ep.ctrl,
                                           ep.group_name)}


def agreement_rows(ep, opts: dict) -> list[dict]:
    """Per CPU op: the full op, the op without the exchange, and `agree` alone, interleaved repeat by
    repeat (the shared machine's load drifts); medians, and the median of the paired differences."""
    from moonep_ops.agreement import agree

    rows = []
    for op, fn in cpu_calls(ep).items():
        samples = dict(full_us=[], bypassed_us=[], agree_alone_us=[])
        for _ in range(opts["repeats"]):
            dist.barrier(ep.group)
            samples["full_us"].append(per_call_us(fn, opts["cpu_calls"], 1))
            with agreement_bypassed():
                samples["bypassed_us"].append(per_call_us(fn, opts["cpu_calls"], 1))
            samples["agree_alone_us"].append(per_call_us(lambda: agree(op, ep.ctrl, ep.group), opts["cpu_calls"], 1))
        diffs = [f - b for f, b in zip(samples["full_us"], samples["bypassed_us"])]
        rows.append(dict(R=ep.cfg.R, op=op, **{k: _median(v) for k, v in samples.items()}, exchange_us=_median(diffs)))
    return rows


def cpu_ranks(rank: int, R: int, opts: dict) -> list[dict]:
    """Every rank: an R = 1 EPGroup on its own 1-rank group, then one over all R ranks (gloo)."""
    from moonep_ops import EPConfig, EPGroup

    solo = [dist.new_group([r]) for r in range(R)][rank]  # collective: every rank makes every subgroup
    rows = []
    for n, group in ((1, solo), (R, dist.group.WORLD)):
        ep = EPGroup(EPConfig(R=n, **CPU_SHAPE), group=group, device="cpu")
        rows += agreement_rows(ep, opts)
        ep.destroy()
    return rows


# --------------------------------------------------------------------------------------------- driver
def print_tables(gpu: list[dict], cpu: list[dict]) -> None:
    for s in gpu:
        print(f"R=1 CUDA {s['name']} {s['shape']}")
        print(f"  {'op':36s} {'calls':>5} {'items':>5} {'host us':>9} {'GPU us':>9}  synced")
        for r in s["rows"]:
            print(f"  {r['op']:36s} {r['calls']:5d} {r['gpu_items']:5d} {r['host_us']:9.1f} {r['gpu_us']:9.1f}  "
                  f"{'YES ' + str(r['sync_debug_error'] or r['profiler_syncs']) if r['synced'] else 'no'}")
        print("  us per launch (stream, CUDA graph): barrier {barrier_stream_us:.2f}, {barrier_graph_us:.2f}; without"
              " the op-id check {unchecked_stream_us:.2f}, {unchecked_graph_us:.2f}; empty {empty_stream_us:.2f},"
              " {empty_graph_us:.2f}\n  per comm op (2 barriers, graph): op-id check {op_check_per_comm_op_us:.3f},"
              " whole barrier {barrier_per_comm_op_us:.2f}".format(**s["barrier"]))
    print(f"CPU reference ops (gloo), per call: {'R':>2} {'op':9s} {'full us':>9} {'no exchange':>11} "
          f"{'exchange':>9} {'agree alone':>11}")
    for r in cpu:
        print(f"{'':36s}{r['R']:2d} {r['op']:9s} {r['full_us']:9.1f} {r['bypassed_us']:11.1f} "
              f"{r['exchange_us']:9.1f} {r['agree_alone_us']:11.1f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU part only (tiny shape); options given still win")
    ap.add_argument("--shapes", default="tiny,design", help=f"GPU shapes, of {sorted(SHAPES)}")
    ap.add_argument("--calls", type=int, default=32, help="GPU: calls per host-cost repeat (upper bound)")
    ap.add_argument("--launches", type=int, default=1000, help="GPU: barrier/empty launches per timing")
    ap.add_argument("--cpu-calls", type=int, default=50, help="CPU: calls per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.smoke:
        apply_smoke_defaults(args, argv, SMOKE)
    names_option(ap, "--shapes", args.shapes, SHAPES)
    if not args.smoke and not torch.cuda.is_available():
        ap.error("the GPU parts need a CUDA device; --smoke runs the CPU part alone")
    return args


def main(argv: list[str] | None = None) -> None:
    from moonep_ops.launch import run_ranks

    args = parse_args(argv)
    opts = vars(args)
    cpu = run_ranks(cpu_ranks, 2, opts)[0]  # rank 0's figures (the ranks run in lock step)
    gpu = [] if args.smoke else [gpu_shape(name, opts) for name in args.shapes.split(",")]
    print_tables(gpu, cpu)
    summary = dict(cpu_exchange_us_R2={r["op"]: r["exchange_us"] for r in cpu if r["R"] == 2})
    if gpu:
        summary.update(op_check_per_comm_op_us={s["name"]: s["barrier"]["op_check_per_comm_op_us"] for s in gpu},
                       barrier_per_comm_op_us={s["name"]: s["barrier"]["barrier_per_comm_op_us"] for s in gpu},
                       any_op_synced=any(r["synced"] for s in gpu for r in s["rows"]))
    payload = dict(run_info(), smoke=args.smoke, opts=opts, cpu_shape=CPU_SHAPE, cpu_agreement=cpu,
                   gpu_r1=gpu if gpu else "skipped (--smoke: CPU only)", summary=summary)
    print("wrote", write_json("bench_op_overhead.json", payload, args.out))


if __name__ == "__main__":
    main()
