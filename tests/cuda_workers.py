"""Per-rank bodies of the multi-GPU tests (spawned by tests/test_ep_cuda.py, one GPU per rank, NCCL).

Every body returns plain data (mismatch lists, flags) that the test asserts on, so a failure on any
rank shows up in the test's report.
"""

import os

import torch
import torch.distributed as dist

from benchmarks.common import host_syncs, run_without_host_sync
from moonep_ops import EPConfig, EPGroup, MoEStatusError, dense_moe, planning
from moonep_ops.status import check_status
from routings import cpu_counts, routings, with_absent_tokens

ops = torch.ops.moonep


def _reference_plan(ids_all: torch.Tensor, cfg: EPConfig, rank: int):
    """The CPU reference outputs of moonep::plan on `rank`."""
    counts = cpu_counts(ids_all, cfg.E)
    gp = planning.plan_global(counts, cfg.S, cfg.K, cfg.B, cfg.P)
    tp = planning.plan_tokens(ids_all[rank], counts, gp, rank)
    return (tp.dst_rank, tp.dst_row, tp.primary_row, gp.experts_to_copy, gp.experts_remote[rank],
            gp.cu_seqlens[rank], gp.group_rows[rank], counts)


PLAN_OUTPUTS = ("dst_rank", "dst_row", "primary_row", "experts_to_copy", "experts_remote", "cu_seqlens",
                "group_rows", "counts")


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
        for j, (name, full) in enumerate(routings(R, cfg.S, cfg.K, cfg.E, seed=100 + i, n=n_routings)):
            # every token present, then ranks routing 0, 1, S or a random number of tokens (rest absent)
            for label, ids_all in ((name, full), (f"{name}-absent", with_absent_tokens(full, j))):
                ref = _reference_plan(ids_all, cfg, rank)
                outs = _plan(ep, ids_all[rank].to(dt).cuda())
                code = int(ep.status.item())
                ep.status.zero_()
                diff = _diff(outs, ref)
                checked += 1
                if diff or code:
                    bad.append((str(kw), label, diff, code))
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
    outs, err = run_without_host_sync(lambda: _plan(ep, ids[1]))
    sync_error = None if err is None else str(err)
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
    from moonep_ops.registry import peers

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


# ------------------------------------------------------------------------------------ dispatch/combine
def _traceable_tokens(r: int, S: int, H: int) -> torch.Tensor:
    """Rank r's token rows: small integers (exact in bf16) that identify (rank, token, column)."""
    s = torch.arange(S)[:, None]
    h = torch.arange(H)[None, :]
    return (((r * S + s) * 7 + h * 3) % 61 - 30).to(torch.bfloat16)


def _route_w(r: int, S: int, K: int) -> torch.Tensor:
    return torch.arange(S * K, dtype=torch.float32).view(S, K) / 1024 + r


def _row_scale(r: int, NvS: int) -> torch.Tensor:
    """Per-row scale of rank r: 1, 1.25, 1.5 or 1.75 (exact in bf16)."""
    return 1 + ((r * 3 + torch.arange(NvS)) % 4).float() / 4


def dispatch_combine_traceable(rank: int, R: int, cfg_kwargs: dict, n_routings: int, n_repeat: int):
    """Rows land exactly at their planned rows on every rank (padding zero), combine sums each token's
    K rows (1 bf16 ulp), route-weight values come back exactly, autograd matches the dense formula,
    repeated steps are bitwise stable, CUDA-graph replay equals eager, no host sync when warm."""
    from moonep_ops import autograd as ag
    from moonep_ops.handles import Plan

    cfg = EPConfig(R=R, **cfg_kwargs)
    c = cfg
    ep = EPGroup(cfg, device="cuda")
    dev = torch.device("cuda")
    fails, max_remote_rows = [], 0
    cases = routings(R, c.S, c.K, c.E, seed=5, n=n_routings)
    xs = [_traceable_tokens(r, c.S, c.H) for r in range(R)]
    for name, ids_all in cases:
        refs = [_reference_plan(ids_all, cfg, r) for r in range(R)]
        plan = _plan(ep, ids_all[rank].cuda())
        dst_rank, dst_row, primary_row, etc, _, cu, group_rows, counts = plan
        x = xs[rank].to(dev)
        route_w = _route_w(rank, c.S, c.K).to(dev)
        rows, row_w, row_primary, row_next = ops.dispatch(x, route_w, dst_rank, dst_row, primary_row, cu,
                                                          group_rows, *ep.dispatch_buffers, ep.ctrl, ep.group_name)
        # expected receive side of this rank, from every rank's reference plan
        exp_rows = torch.zeros(c.NvS, c.H, dtype=torch.bfloat16)
        exp_w = torch.zeros(c.NvS)
        exp_primary = torch.full((c.NvS,), -1, dtype=torch.int32)
        exp_next = torch.full((c.NvS,), -1, dtype=torch.int32)
        for r, ref in enumerate(refs):
            dr, drow, prow = ref[0], ref[1], ref[2]
            nxt = _next_rows(dr, drow)
            sel = dr == rank
            s_idx = torch.nonzero(sel)[:, 0]
            exp_rows[drow[sel].long()] = xs[r][s_idx]
            exp_w[drow[sel].long()] = _route_w(r, c.S, c.K)[sel]
            exp_primary[drow[sel].long()] = prow[sel]
            exp_next[drow[sel].long()] = nxt[sel]
        for what, got, want in (("rows", rows, exp_rows), ("row_w", row_w, exp_w),
                                ("row_primary", row_primary, exp_primary), ("row_next", row_next, exp_next)):
            if not torch.equal(got.cpu(), want):
                fails.append((name, what, int((got.cpu() != want).sum())))
        mine = refs[rank]
        remote = ((mine[1] == mine[2]) & (mine[0] != rank)).sum(1)  # rows of a token crossing the link
        max_remote_rows = max(max_remote_rows, int(remote.max()))
        # combine of per-row scaled rows: y[s] = sum_k x[s] * scale(dst_rank, dst_row)
        scaled = (rows.float() * _row_scale(rank, c.NvS).to(dev)[:, None]).to(torch.bfloat16)
        y = ops.combine(scaled, row_primary, row_next, dst_rank, dst_row, primary_row, ep.presum, ep.ctrl,
                        ep.group_name)
        scale_of = torch.stack([_row_scale(d, c.NvS) for d in range(R)])
        k_scale = scale_of[mine[0].long(), mine[1].long()]  # [S, K]
        y_ref = (xs[rank].float() * k_scale.sum(1, keepdim=True)).to(torch.bfloat16)
        try:
            torch.testing.assert_close(y.cpu().float(), y_ref.float(), rtol=2 ** -7, atol=0)
        except AssertionError as e:
            fails.append((name, "combine", str(e)[:300]))
        g = ops.gather_row_weights(row_w * 3, dst_rank, dst_row, ep.row_scratch, ep.ctrl, ep.group_name)
        if not torch.equal(g.cpu(), _route_w(rank, c.S, c.K) * 3):
            fails.append((name, "gather_row_weights", int((g.cpu() != _route_w(rank, c.S, c.K) * 3).sum())))

        # autograd through dispatch -> row weights -> combine, against the dense formula
        xg = x.clone().float().requires_grad_()
        wg = route_w.clone().requires_grad_()
        dispatched = ag.dispatch(ep, xg.to(torch.bfloat16), wg, Plan(*plan))
        out_rows = (dispatched.rows.float() * dispatched.row_w[:, None]).to(torch.bfloat16)
        y2 = ag.combine(ep, out_rows, Plan(*plan), dispatched)
        gy = _traceable_tokens(rank + 7, c.S, c.H).to(dev) / 16
        y2.float().backward(gy.float())
        x32, gy32 = x.float(), gy.float()
        checks = (("y", y2.float(), (x32[:, None, :] * route_w[:, :, None]).sum(1)),
                  ("dx", xg.grad, route_w.sum(1, keepdim=True) * gy32),
                  ("dw", wg.grad, (gy32 * x32).sum(1, keepdim=True).expand(-1, c.K)))
        for what, got, want in checks:
            try:
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            except AssertionError as e:
                fails.append((name, "autograd " + what, str(e)[:300]))

    # repeated steps bitwise stable, graph replay equal, no host sync (last routing)
    def step():
        rws, rw, rp, rn = ops.dispatch(x, route_w, dst_rank, dst_row, primary_row, cu, group_rows, *ep.dispatch_buffers,
                                       ep.ctrl, ep.group_name)
        return rws, ops.combine(rws, rp, rn, dst_rank, dst_row, primary_row, ep.presum, ep.ctrl, ep.group_name)

    first_rows, first_y = step()
    n_diff = torch.zeros((), dtype=torch.int64, device=dev)
    for _ in range(n_repeat):
        rws, yy = step()
        n_diff += (rws != first_rows).sum() + (yy != first_y).sum()
    repeat_diff = int(n_diff)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_rows, g_y = step()
    graph_ok = True
    for _ in range(3):
        graph.replay()
        graph_ok &= bool(torch.equal(g_rows, first_rows)) and bool(torch.equal(g_y, first_y))
    _, err = run_without_host_sync(step)
    sync_error = None if err is None else str(err)
    status = int(ep.status.item())
    ep.destroy()
    return dict(fails=fails, max_remote_rows=max_remote_rows, repeat_diff=repeat_diff, graph_ok=graph_ok,
                sync_error=sync_error, status=status, n_cases=len(cases))


def _next_rows(dst_rank: torch.Tensor, dst_row: torch.Tensor) -> torch.Tensor:
    """Independent of the library: for each (s, k), dst_row of the first later k' on the same rank."""
    S, K = dst_rank.shape
    out = torch.full((S, K), -1, dtype=torch.int32)
    for k in range(K):
        for k2 in range(k + 1, K):
            hit = (dst_rank[:, k2] == dst_rank[:, k]) & (out[:, k] == -1)
            out[:, k] = torch.where(hit, dst_row[:, k2], out[:, k])
    return out


# ------------------------------------------------------------------------------------------ MoELayer
def _layer_with_global_weights(rank: int, cfg: EPConfig, skew: str, **group_kwargs):
    """A MoELayer on a new EPGroup (options `group_kwargs`) holding this rank's share of
    ``ep_workers.global_weights`` (bf16): (group, layer, this rank's input tokens and output gradient on
    the GPU, the bf16 global (router, w_gate, w_up, w_down) for the dense reference)."""
    import ep_workers
    from moonep_ops import MoELayer

    x_all, router, w_gate, w_up, w_down, grad_out = ep_workers.global_weights(cfg, skew)
    bf = torch.bfloat16
    router, w_gate, w_up, w_down = (t.to(bf) for t in (router, w_gate, w_up, w_down))
    ep = ep_workers.compiling_group(cfg, device="cuda", **group_kwargs)  # its callers torch.compile the layer
    layer = MoELayer(ep)
    mine, tokens = slice(rank * cfg.epn, (rank + 1) * cfg.epn), slice(rank * cfg.S, (rank + 1) * cfg.S)
    with torch.no_grad():
        layer.router.weight.copy_(router)
        layer.experts.w_gate.copy_(w_gate[mine])
        layer.experts.w_up.copy_(w_up[mine])
        layer.experts.w_down.copy_(w_down[mine])
    x = x_all[tokens].to(bf).cuda()
    g = grad_out[tokens].to(bf).cuda()
    return ep, layer, x, g, (router, w_gate, w_up, w_down)


def _forward_backward(layer, x0: torch.Tensor, g: torch.Tensor, fn=None) -> list[torch.Tensor]:
    """(y, and the gradients of x, the router and the three expert weights) of one forward + backward of
    ``fn`` (default: the layer itself) on a fresh copy of x0 with output gradient g, in fp32 on the CPU."""
    layer.zero_grad()
    x = x0.clone().requires_grad_()
    y = (layer if fn is None else fn)(x)
    y.backward(g)
    torch.cuda.synchronize()
    return [t.detach().float().cpu() for t in (y, x.grad, layer.router.weight.grad, layer.experts.w_gate.grad,
                                               layer.experts.w_up.grad, layer.experts.w_down.grad)]


def _dense_reference(layer, cfg: EPConfig, x0: torch.Tensor, g: torch.Tensor, weights) -> list[torch.Tensor]:
    """The dense fp32 reference of this rank's tokens (y and the gradients of x, router, w_gate, w_up,
    w_down): routing fixed to the ids the layer chose, route weights recomputed in fp32 so the router
    gradient is checked."""
    from moonep_ops.routing import route

    with torch.no_grad():
        _, ids = route(layer.router(x0), cfg.K)
    leaves = [t.float().cuda().requires_grad_() for t in (x0, *weights)]
    y = dense_moe(*leaves, K=cfg.K, ids=ids)
    y.backward(g.float())
    return [y.detach().cpu()] + [t.grad.cpu() for t in leaves]


def moe_layer_vs_dense(rank: int, R: int, cfg_kwargs: dict, skew: str, compiled: bool):
    """The whole MoELayer on the GPU (plan, dispatch, prefetch, grouped GEMMs, combine, reduce_grad):
    forward and every gradient, with the dense fp32 reference of this rank's tokens (routing fixed to
    the ids the layer chose, route weights recomputed in fp32 so the router gradient is checked);
    two runs bitwise equal, and layers on EPGroups with the other row modes bitwise equal to them (R = 1:
    the default gathered path against the materialised rows, kept and recomputed; R > 1: the other
    recompute_rows); optionally torch.compile(fullgraph=True) equal to eager."""
    cfg = EPConfig(R=R, **cfg_kwargs)
    names = ["y", "x", "router", "gate", "up", "down"]
    ep, layer, x0, g, weights = _layer_with_global_weights(rank, cfg, skew)
    first = _forward_backward(layer, x0, g)
    second = _forward_backward(layer, x0, g)
    other_modes = ([dict(gather_rows=False, recompute_rows=True), dict(gather_rows=False, recompute_rows=False)]
                   if R == 1 else [dict(recompute_rows=not ep.recompute_rows)])
    rows_mode_differ = []
    for mode in other_modes:
        ep_again, layer_again, *_ = _layer_with_global_weights(rank, cfg, skew, **mode)
        other = _forward_backward(layer_again, x0, g)
        ep_again.destroy()
        rows_mode_differ += [(mode, n) for n, a, b in zip(names, first, other) if not torch.equal(a, b)]
    out = dict(names=names, got=first, bitwise=all(torch.equal(a, b) for a, b in zip(first, second)),
               counts=layer.last_counts.cpu(), gathered=ep.gather_rows, rows_mode_differ=rows_mode_differ)
    if compiled:
        out["compiled"] = _forward_backward(layer, x0, g, torch.compile(layer, fullgraph=True))
    ep.check("moe layer")
    out["ref"] = _dense_reference(layer, cfg, x0, g, weights)
    ep.destroy()
    return out


def one_rank_buffers(rank: int, R: int, cfg_kwargs: dict, skew: str):
    """R = 1 on CUDA allocates only the buffers its kernels read (moonep_ops/buffers.py): the group's
    buffer bytes (`EPGroup.buffer_bytes`) and the memory it and its layer take from this process's
    caching allocator beyond the parameters (all of a lean group's memory; cudaMemGetInfo would count
    the other test processes on the GPU too), the layer's forward and gradients against the dense fp32
    reference and, bitwise, against the same layer on a group with the full symmetric layout (what R = 1
    allocated before: every buffer, symmetric, the GEMMs over the plan's empty slot groups)."""
    from moonep_ops import buffers, group as group_module

    cfg = EPConfig(R=R, **cfg_kwargs)
    full = buffers.BufferLayout(symmetric=True, staged=True, presum=True, copies=True)

    def layout_bytes(layout):
        return sum(buffers.shapes_bytes(shapes(cfg, layout), torch.bfloat16)
                   for shapes in (buffers.group_buffer_shapes, buffers.weight_buffer_shapes))

    def build(layout=None):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        chosen = group_module.buffer_layout
        if layout is not None:  # the full layout: what a 1-rank CUDA group allocated before
            group_module.buffer_layout = lambda c, device_type: layout
        try:
            ep, layer, x0, g, weights = _layer_with_global_weights(rank, cfg, skew)
        finally:
            group_module.buffer_layout = chosen
        torch.cuda.synchronize()
        taken = torch.cuda.memory_allocated() - before
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        return ep, layer, x0, g, weights, dict(buffer_bytes=ep.buffer_bytes, device_bytes=taken - params,
                                               layout=ep.layout)

    ep, layer, x0, g, weights, lean = build()
    got = _forward_backward(layer, x0, g)
    ep.check("one-rank layer")
    out = dict(lean=lean, lean_layout_bytes=layout_bytes(buffers.buffer_layout(cfg, "cuda")),
               full_layout_bytes=layout_bytes(full), names=["y", "x", "router", "gate", "up", "down"], got=got,
               ref=_dense_reference(layer, cfg, x0, g, weights))
    ep.destroy()
    del ep, layer
    ep, layer, x0, g, weights, out["full"] = build(full)
    want = _forward_backward(layer, x0, g)
    ep.check("one-rank layer, full layout")
    out["bitwise_vs_full"] = [name for name, a, b in zip(out["names"], got, want) if not torch.equal(a, b)]
    ep.destroy()
    return out


def moe_layer_tokens_vs_dense(rank: int, R: int, cfg_kwargs: dict, steps: int):
    """MoELayer on the GPU with s <= S tokens per call (different per rank and step, 0 and 1 included):
    per step the output and input gradient against the dense fp32 reference of this rank's present
    tokens (ids as the layer chose them); then the capacity + n_tokens form compiled (fullgraph) over
    `steps` counts: 0 recompiles, rows past the count zero, equal to the eager s form."""
    import ep_workers
    from torch._dynamo.utils import counters

    from moonep_ops.routing import route

    cfg = EPConfig(R=R, **cfg_kwargs)
    ep, layer, x_full, g_full, (router, w_gate, w_up, w_down) = _layer_with_global_weights(rank, cfg, "extreme")
    errs, eager = [], []
    for step in range(steps):
        s = ep_workers.token_counts(cfg, step, rank)
        x = x_full[:s].clone().requires_grad_()
        y = layer(x)
        y.backward(g_full[:s])
        eager.append(y.detach().float().cpu())
        with torch.no_grad():
            _, ids = route(layer.router(x_full[:s]), cfg.K)
        leaves = [t.float().cuda().requires_grad_() for t in (x_full[:s], router, w_gate, w_up, w_down)]
        ref = dense_moe(*leaves, K=cfg.K, ids=ids)
        if s:
            ref.backward(g_full[:s].float())
            for got, want in ((y.detach(), ref.detach()), (x.grad, leaves[0].grad)):
                errs.append(float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)))
    ep.check("moe layer, s <= S")
    counters.clear()
    compiled = torch.compile(lambda x, n: layer(x, n_tokens=n), fullgraph=True)
    cap_bad = []
    with torch.no_grad():
        for step in range(steps):
            s = ep_workers.token_counts(cfg, step, rank)
            y = compiled(x_full, torch.tensor([s], dtype=torch.int32, device="cuda")).float().cpu()
            scale = float(eager[step].abs().max().clamp_min(1e-6)) if s else 1.0  # s = 0: no rows to compare
            err = float((y[:s] - eager[step]).abs().max()) if s else 0.0
            if y[s:].any() or err > 3e-2 * scale:
                cap_bad.append((step, s, err))
    ep.check("moe layer, n_tokens")
    out = dict(max_err=max(errs), cap_bad=cap_bad, recompiles=sum(counters["recompiles"].values()))
    ep.destroy()
    return out


def inference_small_B(rank: int, R: int, cfg_kwargs: dict, B: int, skews: tuple[str, ...]):
    """Inference (no_grad) with B slots < epn: the copies without a slot are read by the grouped GEMMs
    from their home rank's symmetric weights. Per skew: the output against the same layer with B = epn
    (every copy prefetched; each row meets the same weights in the same kernels, so bitwise equal), and
    against the dense fp32 formula; how many copies were read remotely; torch.compile(fullgraph) and a
    CUDA graph of the forward against eager."""
    import ep_workers
    from moonep_ops import MoELayer
    from moonep_ops.routing import route

    bf = torch.bfloat16
    layers = {}
    for b in (B, None):
        cfg = EPConfig(R=R, B=b, **cfg_kwargs)
        layers[b] = MoELayer(ep_workers.compiling_group(cfg, device="cuda"))  # layers[B] runs compiled
    cfg = layers[B].ep.cfg
    mine, tokens = slice(rank * cfg.epn, (rank + 1) * cfg.epn), slice(rank * cfg.S, (rank + 1) * cfg.S)
    out = {}
    with torch.no_grad():
        for skew in skews:
            x_all, router, w_gate, w_up, w_down, _ = ep_workers.global_weights(cfg, skew)
            for layer in layers.values():
                layer.router.weight.copy_(router)
                layer.experts.w_gate.copy_(w_gate[mine])
                layer.experts.w_up.copy_(w_up[mine])
                layer.experts.w_down.copy_(w_down[mine])
            x = x_all[tokens].to(bf).cuda()
            small, full = layers[B](x), layers[None](x)
            _, ids = route(layers[B].router(x), cfg.K)
            plan = ops.plan(ids, cfg.E, cfg.B, cfg.P, cfg.R, layers[B].ep.ctrl, layers[B].ep.group_name)
            n_remote = int((plan[4] >= 0).sum())
            # the dense fp32 MoE with the ids the layer chose
            ref = dense_moe(x.float(), *(t.to(bf).float().cuda() for t in (router, w_gate, w_up, w_down)), K=cfg.K,
                            ids=ids)
            dense_err = float((small.float() - ref).norm() / ref.norm())
            compiled = torch.compile(layers[B], fullgraph=True)(x)
            static_x = torch.zeros_like(x)
            layers[B](static_x)  # warm: every kernel compiled before the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = layers[B](static_x)
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            out[skew] = dict(bitwise_vs_full=bool(torch.equal(small, full)),
                             max_diff_vs_full=float((small.float() - full.float()).abs().max()),
                             dense_err=dense_err, n_remote=n_remote,
                             compiled_diff=float((compiled.float() - small.float()).abs().max()),
                             graph_bitwise=bool(torch.equal(static_y, small)))
    out["status"] = [int(layer.ep.status.item()) for layer in layers.values()]
    for layer in layers.values():
        layer.ep.destroy()
    return out


# ------------------------------------------------------------------------- MoEModel: compiler contract
def _with_nan_filled_empty(fn):
    """fn() with torch.empty and its kin filling what they allocate (NaN for floats, the largest value
    for integers: torch.utils.deterministic.fill_uninitialized_memory, active in deterministic mode;
    warn_only, so ops without a deterministic variant only warn). The previous modes are restored."""
    import torch.utils.deterministic as det

    modes = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        return fn()
    finally:
        torch.use_deterministic_algorithms(modes[0], warn_only=modes[1])
        det.fill_uninitialized_memory = modes[2]


def _differing(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str]) -> dict[str, dict]:
    """The tensors of `got` that are not bitwise equal to `want`'s, by name: how many elements differ
    and the largest absolute difference."""
    out = {}
    for name, a, b in zip(names, got, want, strict=True):
        if not torch.equal(a, b):
            d = (a.float() - b.float()).abs()
            out[name] = dict(n=int((a != b).sum()), max=float(d.max()), of=a.numel())
    return out


def _replay_mismatch(step, model, compiled, skewed, plain, replays, names, ep) -> dict:
    """What tells the causes of a CUDA-graph replay mismatch apart: which tensors differ per replay;
    whether the replays of one input agree with each other (graph vs plain compile); whether the plain
    compiled and the eager step each repeat themselves bitwise on the skewed input (a nondeterministic
    kernel); whether a second plain compilation of the model gives the first one's step (a compilation
    that is not reproducible, rather than the CUDA graphs' memory pool: before torch's and Inductor's
    deterministic modes were set in this worker, the reduce-overhead compile's first call, which cudagraph
    trees run without a graph, differed from the plain compiled step; docs/design-notes.md); and the eager step with
    every torch.empty NaN-filled (the ops' outputs among them: a kernel that reads an element nobody
    wrote, a padding row or an empty group, turns it into NaN there)."""
    out = dict(graphs_differing=[_differing(r, plain[i % 2], names) for i, r in enumerate(replays)],
               replays_vs_first_replay=[_differing(r, replays[i % 2], names) for i, r in enumerate(replays)],
               compiled_repeat_differing=_differing(step(compiled, skewed), step(compiled, skewed), names),
               second_compile_differing=_differing(step(torch.compile(model, fullgraph=True), skewed), plain[1],
                                                   names))
    eager_skewed = step(model, skewed)
    out["eager_repeat_differing"] = _differing(step(model, skewed), eager_skewed, names)
    status_before = int(ep.status.item())
    filled = _with_nan_filled_empty(lambda: step(model, skewed))
    out["eager_nan_filled_nonfinite"] = [n for n, t in zip(names, filled) if not bool(t.isfinite().all())]
    out["eager_nan_filled_differing"] = _differing(filled, eager_skewed, names)
    # a table entry nobody wrote (the largest int32) is flagged by the next kernel that reads it
    out["eager_nan_filled_status"] = int(ep.status.item())
    if not status_before:
        ep.status.zero_()  # reported above; the caller's ep.check reports on the rest of the contract
    return out


def compiled_model_contract(rank: int, R: int, cfg_kwargs: dict, n_layers: int, steps: int):
    """A MoEModel of n_layers blocks (bf16, one EPGroup) on the GPU:
    eager      output and every gradient (the test checks them against the dense fp32 model);
    compiled   torch.compile(fullgraph=True) over `steps` inputs routed differently (some skewed): graphs,
               recompiles, outputs and gradients against eager;
    profiler   host syncs of one warm compiled step, and of the same step with a planted .item();
    graphs     mode="reduce-overhead" (CUDA graphs) on two alternating inputs, replayed: bitwise equal to
               the plain compiled step;
    export     torch.export of the forward against eager;
    memory     peak allocated bytes of an eager and a compiled training step, uniform vs skewed input."""
    from torch._dynamo.utils import counters

    import ep_workers
    from moonep_ops import MoEModel
    from moonep_ops.routing import route

    # The CUDA-graph comparison below is of our ops under graphs, so torch's own run-to-run freedom is
    # fixed in this worker (a process of its own: the settings end with it): Inductor picks some reduction
    # kernels' block sizes by timing them when it compiles (the fp32 summation order), and some torch
    # kernels have nondeterministic variants (atomics) unless deterministic algorithms are asked for. With
    # neither fixed, two compilations of the model (plain and reduce-overhead) differed by a bf16 ulp in a
    # few gradient elements in most H200 runs with recompute_rows on: the first value to differ was block
    # 0's route weights from the compiled router, before any moonep op (checksums of every intermediate);
    # with Inductor's deterministic mode alone 3 of 3 runs still differed, with both 2 of 2 were bitwise
    # equal (docs/design-notes.md). cuBLAS needs its workspace config for reproducible results there.
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before this process's first cuBLAS call
    torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = EPConfig(R=R, **cfg_kwargs)
    bf = torch.bfloat16
    ep = ep_workers.compiling_group(cfg, device="cuda")
    model = MoEModel(ep, n_layers)
    x_all, grad_out = ep_workers.load_model_weights(model, cfg, rank)
    tokens = slice(rank * cfg.S, (rank + 1) * cfg.S)
    g = grad_out[tokens].to(bf).cuda()

    def inputs(i: int) -> torch.Tensor:
        x = torch.randn(cfg.S, cfg.H, generator=torch.Generator().manual_seed(1000 * rank + i))
        if i % 2:  # skewed: feature 0 large, as in ep_workers.global_weights("extreme")
            x[:, 0] = x[:, 0].abs() + 4
        return x.to(bf).cuda()

    def step(fn, x, planted_item=False):
        model.zero_grad()
        x = x.clone().requires_grad_()
        y = fn(x)
        if planted_item:
            float(y.float().sum().item())
        y.backward(g)
        return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]

    out = {}
    chosen = []  # per layer, the experts this rank's tokens went to (for the dense reference)
    hooks = [b.moe.router.register_forward_hook(lambda m, i, logits: chosen.append(route(logits, cfg.K)[1].cpu()))
             for b in model.blocks]
    got = step(model, x_all[tokens].to(bf).cuda())
    for h in hooks:
        h.remove()
    out["eager"] = dict(y=got[0].float().cpu(), x=got[1].float().cpu(), ids=chosen,
                        grads={n: t.float().cpu() for (n, _), t in zip(model.named_parameters(), got[2:])})
    xs = [inputs(i) for i in range(steps)]
    eager = [step(model, x) for x in xs[:3]]
    routings = []
    for x in xs:
        with torch.no_grad():
            model(x)
        routings.append(model.blocks[0].moe.last_counts.sum(0).cpu())
    out["distinct_routings"] = len({tuple(c.tolist()) for c in routings})
    out["max_load"] = max(int(c.max()) for c in routings) / (cfg.S * cfg.K * R / cfg.E)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)
    got = [step(compiled, x) for x in xs]
    out["frames"] = counters["stats"]["unique_graphs"]
    out["recompiles"] = sum(counters["recompiles"].values())
    out["graph_breaks"] = sum(counters["graph_break"].values())
    # relative Frobenius error, the worst tensor: Inductor rounds the bf16 residual stream differently,
    # so a token near a tie of two experts may route differently in layer 2 (a local, not a global, change)
    out["compiled_vs_eager"] = max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))
                                   for ge, gc in zip(eager, got) for a, b in zip(ge, gc))
    torch.cuda.synchronize()
    out["syncs"] = host_syncs(lambda: step(compiled, xs[0]))
    out["syncs_planted"] = host_syncs(lambda: step(compiled, xs[0], planted_item=True))

    # peak memory of a training step: same bytes whatever the routing
    peaks = {}
    for name, fn in (("eager", model), ("compiled", compiled)):
        for skew, x in (("uniform", xs[0]), ("skewed", xs[1])):
            step(fn, x)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step(fn, x)
            torch.cuda.synchronize()
            peaks[f"{name}/{skew}"] = torch.cuda.max_memory_allocated()
    out["peaks"] = peaks

    plain = [step(compiled, x) for x in xs[:2]]
    graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    replays = [step(graphed, xs[i % 2]) for i in range(6)]  # warm-up, record, then replays
    names = ["y", "x.grad"] + [f"{n}.grad" for n, _ in model.named_parameters()]
    out["graphs_bitwise"] = [all(torch.equal(a, b) for a, b in zip(r, plain[i % 2])) for i, r in enumerate(replays)]
    out["graphs_diff"] = max(float((a.float() - b.float()).abs().max()) for i, r in enumerate(replays)
                             for a, b in zip(r, plain[i % 2]))
    if not all(out["graphs_bitwise"]):  # only a mismatch needs telling apart (extra steps)
        out.update(_replay_mismatch(step, model, compiled, xs[1], plain, replays, names, ep))

    exported = torch.export.export(model, (xs[2],))
    with torch.no_grad():
        a, b = exported.module()(xs[3]).float(), model(xs[3]).float()
    out["export_diff"] = float((a - b).abs().max() / b.abs().max())
    ep.check("compiled model contract")
    ep.destroy()
    return out


def precompile_cold(rank: int, R: int, cfg_kwargs: dict, cache_dir: str, log_path: str, workers: int):
    """`precompile` in a process whose kernel disk cache starts empty, for training and then for
    inference: which compile calls each found missing, and the compile-log events of the steps after
    each (a step that compiles nothing itself only loads what the compile-ahead children wrote)."""
    import json

    from csrc_cute import jit
    from moonep_ops import precompile

    os.environ.update({jit.CACHE_DIR_ENV: cache_dir, jit.COMPILE_LOG_ENV: log_path,
                       jit.COMPILE_WORKERS_ENV: str(workers)})

    def events() -> list[tuple[str, str, bool]]:  # (family, event, logged by this process)
        with open(log_path) as f:
            return [(r["family"], r["event"], r["pid"] == os.getpid()) for r in map(json.loads, f)]

    cfg = EPConfig(R=R, **cfg_kwargs)
    ep, layer, x0, g, _ = _layer_with_global_weights(rank, cfg, "uniform")
    out = {}
    for train in (True, False):
        calls = precompile(ep, layer.experts, train=train)
        before = len(events())
        with torch.set_grad_enabled(train):
            x = x0.clone().requires_grad_(train)
            y = layer(x)
            if train:
                y.backward(g)
        torch.cuda.synchronize()
        out["train" if train else "inference"] = dict(
            calls=[(c.module, c.name) for c in calls],
            step_events=[e for e in events()[before:] if e[2]],  # this rank's (the other's children may log)
            again=len(precompile(ep, layer.experts, train=train)), finite=bool(torch.isfinite(y).all()))
    out["events"] = events()
    ep.check("precompile")
    ep.destroy()
    return out
