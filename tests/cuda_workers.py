"""Per-rank bodies of the multi-GPU tests (spawned by tests/test_ep_cuda.py, one GPU per rank, NCCL).

Every body returns plain data (mismatch lists, flags) that the test asserts on, so a failure on any
rank shows up in the test's report.
"""

import torch
import torch.distributed as dist

from moonep_ops import EPConfig, EPGroup, MoEStatusError, planning
from moonep_ops.status import check_status
from routings import cpu_counts, routings

ops = torch.ops.moonep


def _reference_plan(ids_all: torch.Tensor, cfg: EPConfig, rank: int):
    """The CPU reference outputs of moonep::plan on `rank`, or None if the routing overflows B."""
    counts = cpu_counts(ids_all, cfg.E)
    try:
        gp = planning.plan_global(counts, cfg.S, cfg.K, cfg.B, cfg.P)
    except ValueError:
        return None
    tp = planning.plan_tokens(ids_all[rank], counts, gp, rank)
    return (tp.dst_rank, tp.dst_row, tp.primary_row, gp.experts_to_copy, gp.cu_seqlens[rank],
            gp.group_rows[rank], counts)


PLAN_OUTPUTS = ("dst_rank", "dst_row", "primary_row", "experts_to_copy", "cu_seqlens", "group_rows", "counts")


def _plan(ep: EPGroup, ids: torch.Tensor):
    c = ep.cfg
    return ops.plan(ids, c.E, c.B, c.P, c.R, ep.ctrl, ep.group_name)


def _diff(outs, ref) -> list[str]:
    return [n for n, a, b in zip(PLAN_OUTPUTS, outs, ref) if not torch.equal(a.cpu(), b)]


def plan_bitexact(rank: int, R: int, configs: list[dict], n_routings: int):
    """For every config and routing: this rank's CUDA plan against the CPU reference, bit for bit."""
    bad, checked = [], 0
    for i, kw in enumerate(configs):
        dt = kw.pop("ids", torch.int64)
        cfg = EPConfig(R=R, H=8, F=8, **kw)
        ep = EPGroup(cfg, device="cuda")
        for name, ids_all in routings(R, cfg.S, cfg.K, cfg.E, seed=100 + i, n=n_routings):
            ref = _reference_plan(ids_all, cfg, rank)
            outs = _plan(ep, ids_all[rank].to(dt).cuda())
            code = int(ep.status.item())
            ep.status.zero_()
            if ref is None:
                ok = bool(code & 2)  # STATUS_SLOT_OVERFLOW
                checked += 1
                if not ok:
                    bad.append((str(kw), name, "overflow not reported", code))
                continue
            diff = _diff(outs, ref)
            checked += 1
            if diff or code:
                bad.append((str(kw), name, diff, code))
        ep.destroy()
    return dict(bad=bad, checked=checked)


def plan_repeat_graph_nosync(rank: int, R: int, n_launches: int):
    """1000 consecutive plans (barrier epochs advance), CUDA-graph replay, and no host sync."""
    cfg = EPConfig(R=R, S=1024, H=8, K=8, E=48 * R, F=8)
    ep = EPGroup(cfg, device="cuda")
    cases = routings(R, cfg.S, cfg.K, cfg.E, seed=7, n=4)
    refs = [tuple(t.cuda() for t in _reference_plan(ids_all, cfg, rank)) for _, ids_all in cases]
    ids = [ids_all[rank].cuda() for _, ids_all in cases]
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    for i in range(n_launches):
        outs = _plan(ep, ids[i % len(ids)])
        for a, b in zip(outs, refs[i % len(ids)]):
            mismatches += (a != b).sum()
    repeat_bad = int(mismatches)
    repeat_status = int(ep.status.item())

    # CUDA graph: capture one plan on a static input, replay with every routing
    static_ids = ids[0].clone()
    _plan(ep, static_ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _plan(ep, static_ids)
    graph_bad = []
    for rep in range(3):
        for j, ref in enumerate(refs):
            static_ids.copy_(ids[j])
            graph.replay()
            d = [n for n, a, b in zip(PLAN_OUTPUTS, static_out, ref) if not torch.equal(a, b)]
            if d:
                graph_bad.append((rep, j, d))
    # no host sync in a warm plan step
    torch.cuda.synchronize()
    sync_error = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = _plan(ep, ids[1])
    except RuntimeError as e:
        sync_error = str(e)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    nosync_ok = sync_error is None and not _diff(outs, tuple(t.cpu() for t in refs[1]))
    final_status = int(ep.status.item())
    ep.destroy()
    return dict(repeat_bad=repeat_bad, repeat_status=repeat_status, graph_bad=graph_bad, sync_error=sync_error,
                nosync_ok=nosync_ok, final_status=final_status)


def plan_bad_expert_id(rank: int, R: int):
    """An id outside [0, E) on rank 0 is reported by check_status (and nothing hangs)."""
    cfg = EPConfig(R=R, S=64, H=8, K=4, E=8 * R, F=8)
    ep = EPGroup(cfg, device="cuda")
    ids = torch.randint(0, cfg.E, (cfg.S, cfg.K), device="cuda")
    if rank == 0:
        ids[5, 2] = cfg.E + 3
    _plan(ep, ids)
    try:
        ep.check("plan")
        msg = None
    except MoEStatusError as e:
        msg = str(e)
    # the group still works afterwards
    ids[5, 2] = 0
    _plan(ep, ids)
    torch.cuda.synchronize()
    after = int(ep.status.item())
    ep.destroy()
    return dict(msg=msg, after=after)


def barrier_timeout(rank: int, R: int):
    """Rank 1 misses a barrier: rank 0 gets STATUS_TIMEOUT after its short timeout instead of hanging;
    once rank 1 arrives late, both are in step again."""
    import time

    from csrc_cute import sync
    from moonep_ops.group import peers

    cfg = EPConfig(R=R, S=64, H=8, K=4, E=8 * R, F=8)
    ep = EPGroup(cfg, device="cuda")
    pc = peers("barrier", "ctrl", ep.ctrl)
    sync.barrier(pc, ep.ctrl, rank, cfg.E, timeout_s=5.0)  # warm-up: compiled and loaded everywhere
    torch.cuda.synchronize()
    dist.barrier()
    res = {}
    if rank == 0:
        t0 = time.perf_counter()
        sync.barrier(pc, ep.ctrl, rank, cfg.E, timeout_s=0.5)
        torch.cuda.synchronize()
        res["waited_s"] = time.perf_counter() - t0
        try:
            check_status(ep.status, "barrier")
            res["error"] = None
        except MoEStatusError as e:
            res["error"] = str(e)
    dist.barrier()  # host-side: rank 1 now calls the barrier rank 0 gave up on
    if rank != 0:
        sync.barrier(pc, ep.ctrl, rank, cfg.E, timeout_s=5.0)
    sync.barrier(pc, ep.ctrl, rank, cfg.E, timeout_s=5.0)
    torch.cuda.synchronize()
    res["status_after"] = int(ep.status.item())
    ep.destroy()
    return res
