"""Token communication: moonep dispatch/combine (CuTe DSL over NVLink) against the NCCL all-to-all path.

    python benchmarks/bench_comm.py [--out DIR] [--S 8192 --H 7168 --K 8 --epn 48] [--sms 32]
    torchrun --nproc-per-node R benchmarks/bench_comm.py ...      (same, launched by torchrun)

Without torchrun it spawns one process per visible GPU. Per maxvio in {0.2, 1, 2, 5, 10, 20} (capped
at E/K - 1: top-K without replacement gives an expert at most one row per token), on the same routing:
  ours      plan, dispatch, combine, forward (plan + dispatch + combine), backward (combine's backward =
            dispatch, dispatch's backward = combine + gather of the route-weight gradients); eager and
            replayed from a CUDA graph;
  baseline  the path users run today: permute, split sizes to the host, NCCL all_to_all_single, regroup;
            the reverse all_to_all, unpermute and the weighted sum over K; forward and forward+backward
            (autograd), eager (host syncs and data-dependent shapes: no CUDA graph);
  link      peer copy bandwidth (a copy into a peer's symmetric buffer) in the same run.
  hbm       per kernel of one dispatch and one combine (profiled): GPU time, the bytes it reads and
            writes (local HBM and, at R > 1, peers' memory) and GB/s, against the GPU's copy bandwidth
            measured in the same run (a device-to-device copy, read + write counted); per op, the
            op's minimum bytes (its input read once, its output rows written once) over its time.
Remote bytes count the token rows that cross NVLink (ours: one per token and destination rank; the
baseline: one per (token, k) on another rank). Rank 0 prints the table and writes bench_comm.json; the
PNG comes from benchmarks/plot_results.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import combine_pull_bytes, cuda_time_ms, run_info, write_json  # noqa: E402
from benchmarks.routing_gen import routing_for_maxvio  # noqa: E402

MAXVIOS = (0.2, 1.0, 2.0, 5.0, 10.0, 20.0)


def graph_time_ms(fn, iters: int = 20, repeats: int = 5) -> float:
    """fn captured once in a CUDA graph; median over repeats of the mean replay time, in ms."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t = cuda_time_ms(graph.replay, iters=iters, repeats=repeats)
    del graph
    return t


def peer_copy_gbs(rank: int, R: int, group, nbytes: int = 1 << 30) -> float:
    """Bandwidth of copying nbytes from this GPU into the next rank's symmetric buffer (GB/s)."""
    import torch.distributed._symmetric_memory as symm_mem

    n = nbytes // 2
    buf = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(buf, group)
    peer = handle.get_buffer((rank + 1) % R, (n,), torch.bfloat16)
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    dist.barrier(group)
    ms = cuda_time_ms(lambda: peer.copy_(src), iters=10, repeats=5)
    torch.cuda.synchronize()
    dist.barrier(group)
    return nbytes / ms / 1e6


def copy_roof_gbs(nbytes: int = 1 << 31) -> float:
    """This GPU's copy bandwidth (GB/s, read + write counted) of a device-to-device copy of nbytes."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return nbytes / cuda_time_ms(lambda: dst.copy_(src)) / 1e6


def comm_bytes(S: int, R: int, row_bytes: int, dst_rank: torch.Tensor, dst_row: torch.Tensor,
               primary_row: torch.Tensor, row_primary: torch.Tensor) -> dict:
    """Bytes each dispatch/combine kernel of this rank reads and writes (row data and its tables), and each
    op's minimum (its input rows read once, its output rows written once). Send side: this rank's plan
    tables [S, K]; receive side: dispatch's out_primary [NvS] (row_primary: -1 padding, p a chain head,
    another row of the same token otherwise). Counts follow the kernels of csrc_cute/dispatch.py and
    combine.py; at R > 1 some reads come from peers' memory over NVLink. At R = 1 meta stages no rows (the
    pull reads x itself) and combine is one pass (combine_local: each token's rows in, out[s]; no presum)."""
    nvs = row_primary.numel()
    rows = torch.arange(nvs, device=row_primary.device)
    real = int((row_primary >= 0).sum())           # rows that hold a token's copy
    heads = int((row_primary == rows).sum())       # one per (token, this rank)
    present = int((dst_rank >= 0).any(1).sum())    # this rank's tokens that go anywhere
    carriers = int(((dst_row == primary_row) & (dst_rank >= 0)).sum())  # one per (token, destination)
    entries = int((dst_rank >= 0).sum())
    table = 4 * 4  # w, primary, next, src: 4 bytes each per row or (s, k) entry
    staged = 0 if R == 1 else 2 * S * row_bytes                      # x -> send_rows (R > 1 only)
    combine = dict(pull=combine_pull_bytes(real, S, entries, row_bytes)) if R == 1 else dict(
        presum=real * row_bytes + heads * row_bytes + nvs * 8,        # chains in, one row per head out
        pull=combine_pull_bytes(carriers, S, entries, row_bytes))     # carriers' presums in, out[s]
    return {
        "dispatch": dict(
            minimum=(present + real) * row_bytes,
            meta=staged + entries * (12 + table),                       # tables out
            pull=heads * row_bytes + nvs * row_bytes + nvs * (table + 12)),  # rows in, every row out
        "combine": dict(minimum=(real + present) * row_bytes, **combine),
    }


# kernel name pieces (CuTe DSL names a kernel after its function) of each op's GPU work
OP_KERNELS = {"dispatch": ("meta", "pull", "barrier"), "combine": ("presum", "pull", "barrier")}


def hbm_rows(op: str, fn, nbytes: dict, roof_gbs: float) -> list[dict]:
    """One profiled call of op `fn`: per kernel of OP_KERNELS[op] its ms, bytes and GB/s; then the op."""
    from benchmarks.common import kernel_breakdown

    fn()
    torch.cuda.synchronize()
    kernels = kernel_breakdown(fn, show=False, top=None)
    out, total = [], 0.0
    for part in OP_KERNELS[op]:
        ms = sum(t for n, t in kernels if f"_{part}_kernel" in n)
        b = nbytes[op].get(part, 0)
        if not ms and not b:
            continue  # a kernel this R does not run (R = 1: combine's presum)
        total += ms
        out.append(dict(op=op, kernel=part, ms=ms, bytes=b, gbs=b / ms / 1e6 if ms > 0 and b else None))
    other = sum(t for _, t in kernels) - total  # anything else the op launched
    b = nbytes[op]["minimum"]
    out.append(dict(op=op, kernel="whole op (minimum bytes)", ms=total + other, bytes=b,
                    gbs=b / (total + other) / 1e6, other_ms=other))
    for r in out:
        r["of_copy_roof"] = None if r["gbs"] is None else r["gbs"] / roof_gbs
    return out


def bench_rank(rank: int, R: int, opts: dict) -> list[dict]:
    from benchmarks.baseline_ep import baseline_combine, baseline_dispatch
    from moonep_ops import EPConfig, EPGroup, planning
    from moonep_ops.handles import Plan

    ops = torch.ops.moonep
    S, H, K, epn = opts["S"], opts["H"], opts["K"], opts["epn"]
    E = epn * R
    cfg = EPConfig(S=S, H=H, K=K, E=E, F=8, R=R)
    ep = EPGroup(cfg, device="cuda", comm_sms=opts["sms"])
    group = ep.group
    link = peer_copy_gbs(rank, R, group) if R > 1 else float("nan")
    roof = copy_roof_gbs()
    x = (torch.randn(S, H, device="cuda") / 4).to(torch.bfloat16)
    g_out = (torch.randn(S, H, device="cuda") / 4).to(torch.bfloat16)
    rows = []
    for target in [m for m in MAXVIOS if m <= E / K - 1 + 1e-9]:
        ids_all, _, realized = routing_for_maxvio(R, S, E, K, target, seed=opts["seed"])
        ids = ids_all[rank].cuda()
        counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids_all]).int()
        route_w = torch.softmax(torch.randn(S, K, device="cuda"), 1)
        plan = Plan(*ops.plan(ids, E, cfg.B, cfg.P, R, ep.ctrl, ep.group_name))
        dst_rank, dst_row, primary_row, cu, group_rows = (plan.dst_rank, plan.dst_row, plan.primary_row,
                                                          plan.cu_seqlens, plan.group_rows)
        recv = ep.dispatch_buffers

        def do_plan():
            return ops.plan(ids, E, cfg.B, cfg.P, R, ep.ctrl, ep.group_name)

        def do_dispatch():
            return ops.dispatch(x, route_w, dst_rank, dst_row, primary_row, cu, group_rows, *recv, ep.ctrl,
                                ep.group_name)

        d_rows, d_w, d_primary, d_next = do_dispatch()

        def do_combine():
            return ops.combine(d_rows, d_primary, d_next, dst_rank, dst_row, primary_row, ep.presum, ep.ctrl,
                               ep.group_name)

        def do_forward():
            p = Plan(*do_plan())
            r_rows, _, r_primary, r_next = ops.dispatch(x, route_w, p.dst_rank, p.dst_row, p.primary_row,
                                                        p.cu_seqlens, p.group_rows, *recv, ep.ctrl, ep.group_name)
            return ops.combine(r_rows, r_primary, r_next, p.dst_rank, p.dst_row, p.primary_row, ep.presum, ep.ctrl,
                               ep.group_name)

        unit_w = torch.ones(S, K, device="cuda")

        def do_backward():
            g_rows, _, _, _ = ops.dispatch(g_out, unit_w, dst_rank, dst_row, primary_row, cu, group_rows, *recv,
                                           ep.ctrl, ep.group_name)
            gx = ops.combine(g_rows, d_primary, d_next, dst_rank, dst_row, primary_row, ep.presum, ep.ctrl,
                             ep.group_name)
            return gx, ops.gather_row_weights(d_w, dst_rank, dst_row, ep.row_scratch, ep.ctrl, ep.group_name)

        ours = {}
        for name, fn in (("plan", do_plan), ("dispatch", do_dispatch), ("combine", do_combine),
                         ("forward", do_forward), ("backward", do_backward)):
            ours[name] = (cuda_time_ms(fn), graph_time_ms(fn))
        nbytes = comm_bytes(S, R, H * x.element_size(), dst_rank, dst_row, primary_row, d_primary)
        hbm = hbm_rows("dispatch", do_dispatch, nbytes, roof) + hbm_rows("combine", do_combine, nbytes, roof)
        ep.check("bench_comm")

        def base_forward():
            grouped, rt = baseline_dispatch(x, ids, E, group)
            return baseline_combine(grouped, route_w, rt, group)

        xg = x.clone().requires_grad_()
        wg = route_w.clone().requires_grad_()

        def base_fwd_bwd():
            grouped, rt = baseline_dispatch(xg, ids, E, group)
            y = baseline_combine(grouped, wg, rt, group)
            y.backward(g_out)

        grouped, rt = baseline_dispatch(x, ids, E, group)
        base = dict(dispatch=cuda_time_ms(lambda: baseline_dispatch(x, ids, E, group)),
                    combine=cuda_time_ms(lambda: baseline_combine(grouped, route_w, rt, group)),
                    forward=cuda_time_ms(base_forward), fwd_bwd=cuda_time_ms(base_fwd_bwd))
        row_bytes = H * x.element_size()
        mine = (dst_rank != rank)
        ours_remote = int(((dst_row == primary_row) & mine).sum()) * row_bytes  # per direction
        base_remote = int(mine.sum()) * row_bytes
        logical = S * K * row_bytes
        rows.append(dict(
            maxvio_target=target, maxvio=realized, rank_imbalance=planning.rank_imbalance(counts),
            logical_bytes=logical, ours_remote_bytes=ours_remote, baseline_remote_bytes=base_remote,
            peer_copy_gbs=link, copy_roof_gbs=roof, comm_sms=ep.comm_sms, hbm=hbm,
            **{f"ours_{k}_ms": v[0] for k, v in ours.items()},
            **{f"ours_{k}_graph_ms": v[1] for k, v in ours.items()},
            **{f"baseline_{k}_ms": v for k, v in base.items()}))
        dist.barrier(group)
    ep.destroy()
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'maxvio':>7} {'imbal':>6} | {'ours disp':>9} {'graph':>7} {'comb':>7} {'graph':>7} {'plan':>6} "
          f"{'fwd':>7} {'bwd':>7} | {'base disp':>9} {'comb':>7} {'fwd':>7} {'fwd+bwd':>8} | "
          f"{'remote MB':>9} {'GB/s d':>7} {'GB/s c':>7} {'link':>6} | {'fwd x':>6}")
    for r in rows:
        mb = r["ours_remote_bytes"] / 1e6
        print(f"{r['maxvio']:7.2f} {r['rank_imbalance']:6.2f} | {r['ours_dispatch_ms']:9.3f} "
              f"{r['ours_dispatch_graph_ms']:7.3f} {r['ours_combine_ms']:7.3f} {r['ours_combine_graph_ms']:7.3f} "
              f"{r['ours_plan_ms']:6.3f} {r['ours_forward_ms']:7.3f} {r['ours_backward_ms']:7.3f} | "
              f"{r['baseline_dispatch_ms']:9.3f} {r['baseline_combine_ms']:7.3f} {r['baseline_forward_ms']:7.3f} "
              f"{r['baseline_fwd_bwd_ms']:8.3f} | {mb:9.1f} {mb / r['ours_dispatch_graph_ms']:7.1f} "
              f"{mb / r['ours_combine_graph_ms']:7.1f} {r['peer_copy_gbs']:6.1f} | "
              f"{r['baseline_forward_ms'] / r['ours_forward_ms']:6.2f}", flush=True)


def print_hbm(rows: list[dict]) -> None:
    r = rows[0]
    print(f"HBM, rank 0, maxvio {r['maxvio']:.2f} (copy roof {r['copy_roof_gbs']:.0f} GB/s, read + write):")
    for k in r["hbm"]:
        gbs = "" if k["gbs"] is None else f"{k['gbs']:8.0f} GB/s {100 * k['of_copy_roof']:5.1f}% of the copy roof"
        print(f"  {k['op']:9s} {k['kernel']:26s} {k['ms'] * 1e3:8.1f} us {k['bytes'] / 1e6:9.1f} MB {gbs}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--H", type=int, default=7168)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--epn", type=int, default=48)
    ap.add_argument("--sms", type=int, default=None,
                    help="CTAs of the dispatch/combine kernels (default: the EP group's, all SMs at R = 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    opts = vars(args)
    if "LOCAL_RANK" in os.environ:  # torchrun
        rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
        rows = bench_rank(rank, R, opts)
        dist.destroy_process_group()
    else:
        from moonep_ops.launch import run_ranks

        R = torch.cuda.device_count()
        rank, rows = 0, run_ranks(bench_rank, R, opts, backend="nccl")[0]
    if rank == 0:
        print_table(rows)
        print_hbm(rows)
        info = dict(run_info(), R=R, S=args.S, H=args.H, K=args.K, epn=args.epn, comm_sms=rows[0]["comm_sms"])
        print("wrote", write_json("bench_comm.json", dict(info, results=rows), args.out))


if __name__ == "__main__":
    main()
