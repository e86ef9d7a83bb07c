"""Inference: one MoE layer's forward (no_grad) with few copy slots (B < epn), all slots, and the standard EP path.

    python benchmarks/bench_inference.py [--out DIR] [--S 4096 8192 --H 7168 --F 2048 --K 8 --epn 48 --P 128]
        [--small-B 3] [--maxvios 0.2 1 2 5 10] [--variants ...] [--iters 10 --repeats 5 --warmup 3]
    torchrun --nproc-per-node R benchmarks/bench_inference.py ...   (same, launched by torchrun)
    python benchmarks/bench_inference.py --smoke                   (tiny shapes, CPU, gloo, 2 processes, B=0)

The trade: with B = epn each rank has a slot for every copy the planner can make, and the slot pools cost
3*epn*H*F*2 bytes (shared by all layers). With B = 3 the slots go to the 3 copies with the most rows and the
grouped GEMMs read the other copies' weights from their home rank through the peer mapping (NVLink): that saves
(epn-B)*3*H*F*2 bytes (3.96 GB = 3.69 GiB at H=7168 F=2048 epn=48) and costs remote weight reads, each M tile of
a remote group reading its B operand (3*H*F*2 bytes: gate, up, down) over the link. The cost grows with the copies
the routing needs, so it is measured per maxvio. Note: with routing_gen's skews the CPU planner makes at most 2
copies per rank (S=4096/8192, epn=48, K=8, R=2/4/8, maxvio <= 20), so B=3 reads nothing remotely there
(`remote_groups` 0); --small-B 1 or 0 measures the remote reads themselves.

Variants, built and freed one after another (one EPGroup per B; the graph variant replays the ours_b3 layer):
  ours_full       MoELayer, B = epn, eager          ours_b3   MoELayer, B = --small-B, eager
  ours_b3_graph   the ours_b3 forward captured once in a CUDA graph (after warm-up on a side stream) and replayed
                  at every maxvio: the routing changes inside the graph (CUDA only)
  base            baseline_ep.BaselineMoE: NCCL all_to_all_single with host split sizes + torch._grouped_mm
Routing is forced as in bench_e2e (routing_gen's ForcedRouter + Routings; the logit bias updated in place between maxvios;
maxvio capped at E/K - 1). Per (S, variant, maxvio), `{variant}_{field}` in a row: `ms` (median over --repeats
of the mean of --iters forwards, CUDA events, max over ranks), `peak_gb` (max_memory_allocated of one forward),
`device_used_gb` (cudaMemGetInfo: symmetric memory may miss the allocator's counters), `routing_ok` (top-K =
target), `planned_counts_ok` (the layer planned on the target's counts), `rel_diff_vs_full` (max|y - y_full| /
max|y_full|: every module is built from the same seed, so holds the same weights), and for ours per rank, from
moonep.plan on the layer's ids: `slots_used` (experts_to_copy >= 0), `remote_groups` (experts_remote >= 0),
`remote_rows`, `remote_tiles` (M tiles) and `remote_read_gb_est` = remote_tiles*3*H*F*2 / 2**30. `pools`: slot
pool and fp32 reduce-buffer bytes per B. Rank 0 writes bench_inference.json and .log (run_info: GPU, command,
commit, date); benchmarks/plot_results.py draws bench_inference.png.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.baseline_ep import BaselineMoE  # noqa: E402
from benchmarks.common import (Bench, apply_smoke_defaults, capture, names_option, run_info, short_error,  # noqa: E402
                               write_json)
from benchmarks.routing_gen import ForcedRouter, Routings, counts_of, realized_maxvio  # noqa: E402

VARIANTS = ("ours_full", "ours_b3", "ours_b3_graph", "base")
MAXVIOS = (0.2, 1.0, 2.0, 5.0, 10.0)
# smoke: B = 0, as at these shapes the planner makes at most one copy per rank and B = 3 would read nothing remotely
SMOKE = dict(S=[32, 64], H=64, F=32, K=2, epn=8, P=16, small_B=0, iters=2, repeats=1, warmup=1)


def plan_usage(b: Bench, layer, ids: torch.Tensor) -> dict:
    """What the plan of `ids` uses on each rank: slots, remote groups, their rows and M tiles (collective)."""
    ep, c = layer.ep, layer.ep.cfg
    out = torch.ops.moonep.plan(ids, c.E, c.B, c.P, c.R, ep.ctrl, ep.group_name)
    to_copy, remote, group_rows = out[3], out[4], out[6]
    rows = group_rows[c.epn + c.B:].long()  # groups: epn home, B slots, epn - B remote
    tile_m = 128 if c.P >= 128 else 64  # group_gemm's M tile
    mine = torch.stack([(to_copy[b.rank] >= 0).sum(), (remote >= 0).sum(), rows.sum(),
                        ((rows + tile_m - 1) // tile_m).sum()]).long()
    per_rank = [torch.empty_like(mine) for _ in range(b.R)]
    dist.all_gather(per_rank, mine)
    res = {n: [int(r[i]) for r in per_rank] for i, n in enumerate(("slots_used", "remote_groups", "remote_rows",
                                                                     "remote_tiles"))}
    res["remote_read_gb_est"] = [n * 3 * c.H * c.F * 2 / 2**30 for n in res["remote_tiles"]]
    return res


def measure(b: Bench, v: str, module, routings: Routings, x: torch.Tensor, rows: dict, ref: dict, notes: dict):
    """Time variant `v` of `module` at every target maxvio; results go into rows[t] as `{v}_{field}`."""
    from moonep_ops import MoEStatusError
    from moonep_ops.routing import route

    ep, S, graph, out = getattr(module, "ep", None), x.shape[0], None, None
    if v == "ours_b3_graph":  # captured once (at the first maxvio), replayed at every maxvio
        module.router.set_ids(routings.by_target[next(iter(rows))][0][b.rank])
        try:
            graph, out = capture(lambda: module(x), max(2, b.opts["warmup"])) if b.cuda else (None, None)
        except Exception as e:  # noqa: BLE001  (recorded; every rank fails alike)
            notes[f"S{S}_{v}"] = "CUDA graph capture failed: " + short_error(e)
        if graph is None:
            notes.setdefault(f"S{S}_{v}", "skipped: CUDA graphs need CUDA")
            return b.log(f"S={S} {v}: {notes[f'S{S}_{v}']}")
    step = graph.replay if graph is not None else (lambda: module(x))
    for t, row in rows.items():
        module.router.set_ids(routings.by_target[t][0][b.rank])
        res, t_start, failed = {}, time.perf_counter(), 0.0
        try:
            for _ in range(b.opts["warmup"]):
                step()
            b.sync()
            res["ms"] = b.time_ms(step)
            if ep is not None:
                ep.check(f"bench_inference {v}")
            res["peak_gb"], _, res["device_used_gb"] = b.memory(step, lambda: None)
            y = (out if graph is not None else step()).float().cpu()
        except (torch.OutOfMemoryError, MoEStatusError) as e:
            failed = b.failure(e, f"S={S} {v}", ep)
        error = b.agreed_error(failed)
        if error:
            res = dict(error=error)
        else:
            if v == "ours_full":
                ref[t] = y
            diff = float((y - ref[t]).abs().max() / ref[t].abs().max()) if t in ref else None
            res["ms"], res["peak_gb"], res["device_used_gb"], res["rel_diff_vs_full"] = b.agree(
                [res["ms"], res["peak_gb"], res["device_used_gb"], diff])
        if graph is None:  # eager: routing checks and the plan's use of slots / remote groups
            ids, want = route(module.router(x), b.opts["K"])[1], routings.by_target[t][0]
            res["routing_ok"] = not b.agree([float(not torch.equal(ids.sort(1).values.cpu(),
                                                                   want[b.rank].sort(1).values))])[0]
            if ep is not None:
                res["planned_counts_ok"] = not b.agree([float(module.last_counts is None or not torch.equal(
                    module.last_counts.cpu().int(), counts_of(want, ep.cfg.E)))])[0]
                res.update(plan_usage(b, module, ids))
        row.update({f"{v}_{k}": val for k, val in res.items()})
        shown = f"{res['ms']:.3f} ms" if "ms" in res else res["error"]
        shown += f", slots {res['slots_used']} remote {res['remote_groups']}" if "slots_used" in res else ""
        b.log(f"S={S} {v:14s} maxvio {t:5.1f}: {shown}  ({time.perf_counter() - t_start:.1f}s)")


def bench_rank(rank: int, R: int, opts: dict) -> dict:
    from moonep_ops import EPConfig, EPGroup, MoELayer, planning

    cuda = opts["device"] == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    H, F, K, epn, P, small_B = (opts[k] for k in ("H", "F", "K", "epn", "P", "small_B"))
    E, dtype = epn * R, torch.bfloat16
    b = Bench(rank, R, opts, device, dist.group.WORLD, name="bench_inference")
    warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated.*")  # baseline_ep's choice
    cap, asked = E / K - 1, opts["maxvios"] or MAXVIOS
    targets, skipped = [m for m in asked if m <= cap + 1e-9], [m for m in asked if m > cap + 1e-9]
    b.log(f"R={R} S={opts['S']} H={H} F={F} K={K} E={E} epn={epn} P={P} B={epn}/{small_B} on {device}; maxvio "
          f"{targets}" + (f" (skipped {skipped}: above E/K-1 = {cap:.2f})" if skipped else ""))
    out_rows, notes, pools = [], {}, {}
    for S in opts["S"]:
        routings = Routings(R, S, E, K, targets, 1, opts["seed"])
        rows = {t: dict(S=S, maxvio_target=t, maxvio=realized_maxvio(routings.by_target[t][0], E),
                        rank_imbalance=planning.rank_imbalance(counts_of(routings.by_target[t][0], E)))
                for t in targets}
        x = torch.randn(S, H, generator=torch.Generator().manual_seed(1234 + rank)).to(device=device, dtype=dtype)
        ref: dict = {}
        for B, names in ((epn, ["ours_full"]), (small_B, ["ours_b3", "ours_b3_graph"]), (None, ["base"])):
            names, ep = [v for v in names if v in opts["variants"]], None
            if not names:
                continue
            if B is not None:
                ep = EPGroup(EPConfig(S=S, H=H, K=K, E=E, F=F, R=R, P=P, B=B), dtype=dtype, device=device,
                             timeout_s=opts["comm_timeout"], **({"comm_sms": opts["sms"]} if cuda else {}))
            torch.manual_seed(opts["seed"] + 7919 * rank)  # the same weights in every variant
            module = BaselineMoE(S, H, F, K, E, R, dtype, device) if ep is None else MoELayer(ep)
            if ep is not None:
                # an inference-only group (B < epn) allocates no fp32 gradient buffers
                reduce = ep.reduce_buffers if B == epn else ()
                pools["ours_full" if B == epn else "ours_b3"] = dict(B=B, **{
                    f"{k}_bytes": sum(p.numel() * p.element_size() for p in bufs)
                    for k, bufs in (("pool", ep.pools), ("reduce", reduce))})
            module.router = ForcedRouter(module.router, S)
            with torch.no_grad():
                for v in names:
                    measure(b, v, module, routings, x, rows, ref, notes)
                    b.free()
            del module
            if ep is not None:
                ep.destroy()
            b.free()
        out_rows += rows.values()
    return dict(rows=out_rows, notes=notes, pools=pools, targets=targets, skipped=skipped, log=b.lines)


def report(rows: list[dict], variants: list[str]) -> list[str]:
    """Ratios into the rows, and the table (lines) rank 0 prints and logs."""
    def f(v, w=8, p=2):
        return f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else f"{v or '-':>{w}}"
    short = dict(ours_full="full", ours_b3="b3", ours_b3_graph="b3 graph", base="base")
    lines = ["forward ms (max over ranks) | b3/full | peak GB | ours_b3 per rank: slots used, remote groups, rows, "
             "read GB (est)",
             f"{'S':>5} {'maxvio':>6} {'imbal':>5} | " + " ".join(f"{short[v]:>8}" for v in variants)
             + f" | {'b3/full':>7} | " + " ".join(f"{short[v]:>8}" for v in variants) + " | b3 plan"]
    for r in rows:
        ms = {v: r.get(f"{v}_ms") for v in variants}
        r["b3_over_full"] = ms["ours_b3"] / ms["ours_full"] if ms.get("ours_b3") and ms.get("ours_full") else None
        r["full_speedup_vs_base"] = ms["base"] / ms["ours_full"] if ms.get("base") and ms.get("ours_full") else None
        plan = (f"{r['ours_b3_slots_used']} {r['ours_b3_remote_groups']} {r['ours_b3_remote_rows']} "
                f"{[round(g, 2) for g in r['ours_b3_remote_read_gb_est']]}") if "ours_b3_slots_used" in r else "-"
        lines.append(f"{r['S']:5d} {r['maxvio']:6.2f} {r['rank_imbalance']:5.2f} | "
                     + " ".join(f(ms[v] if ms[v] is not None else r.get(f"{v}_error")) for v in variants)
                     + f" | {f(r['b3_over_full'], 7, 3)} | " + " ".join(f(r.get(f"{v}_peak_gb")) for v in variants)
                     + f" | {plan}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="result dir (default benchmarks/results; smoke: a temp dir)")
    ap.add_argument("--S", type=int, nargs="+", default=[4096, 8192], help="tokens per rank (one sweep each)")
    for k, v in dict(H=7168, F=2048, K=8, epn=48, P=128).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--small-B", type=int, default=3, help="copy slots per rank of ours_b3")
    ap.add_argument("--maxvios", type=float, nargs="*", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    for k, v, h in (("iters", 10, "forwards per timed repeat"), ("repeats", 5, "timed repeats (median)"),
                    ("warmup", 3, "warm-up forwards per config"), ("sms", 32, "CTAs of dispatch/combine kernels")):
        ap.add_argument(f"--{k}", type=int, default=v, help=h)
    ap.add_argument("--comm-timeout", type=float, default=600.0, help="EPGroup.timeout_s (device-side waits)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU with gloo, 2 processes")
    args = ap.parse_args(argv)
    if args.smoke:
        apply_smoke_defaults(args, argv, SMOKE)
    opts = vars(args)
    opts["variants"] = names_option(ap, "--variants", args.variants, VARIANTS)
    t0, backend = time.perf_counter(), "gloo" if args.smoke else "nccl"
    opts["device"] = "cpu" if args.smoke else "cuda"
    if "LOCAL_RANK" in os.environ:  # torchrun
        rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not args.smoke:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
        res = bench_rank(rank, R, opts)
        dist.barrier()
        dist.destroy_process_group()
    else:
        from moonep_ops.launch import run_ranks

        R = 2 if args.smoke else torch.cuda.device_count()
        if R < 1:
            raise SystemExit("bench_inference: no CUDA device (use --smoke for the CPU check)")
        rank, res = 0, run_ranks(bench_rank, R, opts, backend=backend)[0]
    if rank != 0:
        return
    variants = [v for v in VARIANTS if v in opts["variants"]]
    lines = report(res["rows"], variants)
    if res["skipped"]:
        lines.append(f"maxvio {res['skipped']} skipped: above E/K - 1 = {args.epn * R / args.K - 1:.2f}")
    pools = res["pools"]
    lines += [f"slot pools per rank, {v} (B={p['B']}): {p['pool_bytes'] / 1e9:.3f} GB (+ fp32 reduce buffers "
              f"{p['reduce_bytes'] / 1e9:.3f} GB)" for v, p in pools.items()]
    lines += [f"note: {k}: {v}" for k, v in res["notes"].items()]
    print("\n".join(lines), flush=True)
    info = dict(run_info(), R=R, E=args.epn * R, dtype="bfloat16", variants=variants, comm_sms=args.sms,
                wall_s=round(time.perf_counter() - t0, 1), **{k: opts[k] for k in (
                    "S", "H", "F", "K", "epn", "P", "small_B", "device", "iters", "repeats", "warmup", "smoke")})
    out_dir = args.out
    if out_dir is None and args.smoke:  # smoke figures are no results: keep them out of benchmarks/results
        import tempfile
        out_dir = tempfile.mkdtemp(prefix="bench_inference_smoke_")
    path = write_json("bench_inference.json", dict(info, pools=pools, rows=res["rows"], notes=res["notes"]), out_dir)
    with open(path.replace(".json", ".log"), "w") as fh:
        fh.write("\n".join(res["log"] + lines) + "\n")
    print("wrote", path, "and bench_inference.log", f"({info['wall_s']} s)", flush=True)


if __name__ == "__main__":
    main()
