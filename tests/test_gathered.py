"""The gathered path of a 1-rank group on the CPU (moonep_ops/ops_gathered.py): each op bitwise the
materialised op on the gathered rows, its argument rules, and the layer with EPGroup(gather_rows) (the
default at R = 1) bitwise the layer on dispatched rows, eager, compiled, padded and inference."""

import pytest
import torch

import moonep_ops  # noqa: F401  (registers the ops)
from moonep_ops import EPConfig, EPGroup, MoELayer
from moonep_ops import autograd as ag

ops = torch.ops.moonep
CFG = EPConfig(S=12, H=16, K=3, E=4, F=8, R=1, P=16)


def _dispatched(group, cfg=CFG, seed=0):
    """A plan of random top-k ids, and one dispatch of random tokens along it (both forms) on one group."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(cfg.E, generator=gen)[:cfg.K] for _ in range(cfg.S)])
    ids[1] = -1  # an absent token: neither sent nor computed
    ep = EPGroup(cfg)
    ep.alloc_weight_buffers()
    plan = ag.plan(ep, ids)
    x = torch.randn(cfg.S, cfg.H, generator=gen)
    route_w = torch.rand(cfg.S, cfg.K, generator=gen)
    tables = (plan.dst_rank, plan.dst_row, plan.primary_row, plan.cu_seqlens, plan.group_rows)
    rows, *row_tables = ops.dispatch(x, route_w, *tables, *ep.dispatch_buffers, ep.ctrl, group)
    index = ops.dispatch_index(x, route_w, *tables, *ep.dispatch_buffers[1:], ep.ctrl, group)
    return ep, plan, x, rows, row_tables, index


def test_dispatch_index_is_dispatch_without_rows(gloo1):
    """dispatch_index returns dispatch's row tables bitwise, and row_src names each row's token: dispatch's
    rows are x[row_src] (zero rows where -1: padding and past the last group)."""
    _, plan, x, rows, row_tables, (row_w, row_primary, row_next, row_src) = _dispatched(gloo1)
    for name, a, b in zip(("row_w", "row_primary", "row_next"), row_tables, (row_w, row_primary, row_next)):
        assert torch.equal(a, b), name
    routed = row_src >= 0
    assert int(routed.sum()) == int((plan.dst_rank >= 0).sum()) == (CFG.S - 1) * CFG.K
    assert torch.equal(rows[routed], x[row_src[routed].long()]) and not rows[~routed].any()
    assert torch.equal(routed, row_primary >= 0)
    for s, k in ((0, 0), (5, 2), (CFG.S - 1, 1)):  # a traceable entry: the token's row holds its index
        assert int(row_src[plan.dst_row[s, k]]) == s


def test_gathered_gemms_are_the_plain_ops_on_gathered_rows(gloo1):
    """Each gathered GEMM op (x or g_out [S, *] read by row_src) is bitwise the plain op on rows[row_src]."""
    ep, plan, x, rows, (row_w, *_), (_, _, _, row_src) = _dispatched(gloo1)
    c, cu = CFG, plan.cu_seqlens
    w_gate, w_up = torch.randn(c.epn, c.H, c.F), torch.randn(c.epn, c.H, c.F)
    w_down, slots = torch.randn(c.epn, c.F, c.H), torch.randn(c.B, c.H, c.F)
    got = ops.group_gemm_swiglu_gather(x, row_src, w_gate, slots, w_up, slots, cu, c.P, True)
    want = ops.group_gemm_swiglu(rows, w_gate, slots, w_up, slots, cu, c.P, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and want[0].abs().sum() > 0
    _, gate, up = want
    g_out = torch.randn(c.S, c.H)
    g_y = ops.dispatch(g_out, torch.ones(c.S, c.K), plan.dst_rank, plan.dst_row, plan.primary_row, cu,
                       plan.group_rows, *ep.dispatch_buffers, ep.ctrl, gloo1)[0]  # combine's backward
    down_slots = torch.zeros(c.B, c.F, c.H)
    got = ops.group_gemm_swiglu_bwd_gather(g_out, row_src, w_down, down_slots, cu, row_w, gate, up, c.P)
    want = ops.group_gemm_swiglu_bwd(g_y, w_down, down_slots, cu, row_w, gate, up, c.P)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and want[0].abs().sum() > 0
    h_w = want[2]
    for name, gathered, plain, shape in (
            ("wgrad_gather", lambda dw, ds: ops.group_gemm_wgrad_gather(x, row_src, gate, cu, dw, ds, c.P),
             lambda dw, ds: ops.group_gemm_wgrad(rows, gate, cu, dw, ds, c.P), (c.H, c.F)),
            ("wgrad_gather_b", lambda dw, ds: ops.group_gemm_wgrad_gather_b(h_w, g_out, row_src, cu, dw, ds, c.P),
             lambda dw, ds: ops.group_gemm_wgrad(h_w, g_y, cu, dw, ds, c.P), (c.F, c.H))):
        outs = []
        for fn in (gathered, plain):
            dw_home, dw_slot = torch.full((c.epn, *shape), 7.0), torch.ones(c.B, *shape)
            fn(dw_home, dw_slot)
            outs.append((dw_home, dw_slot))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), name
        assert outs[0][0].abs().sum() > 0 and not (outs[0][0] == 7).all(), name


def test_gathered_ops_refuse_bad_row_src(gloo1):
    """row_src must index the source rows ([-1, S)) and hold one entry per row: errors name the op and
    row_src before anything runs."""
    _, plan, x, _, _, (_, _, _, row_src) = _dispatched(gloo1)
    c, cu = CFG, plan.cu_seqlens
    w, slots = torch.randn(c.epn, c.H, c.F), torch.zeros(c.B, c.H, c.F)
    bad = row_src.clone()
    bad[3] = c.S
    with pytest.raises(ValueError, match=r"group_gemm_swiglu_gather: row_src\[3\] = 12 is outside \[-1, S=12"):
        ops.group_gemm_swiglu_gather(x, bad, w, slots, w, slots, cu, c.P, True)
    with pytest.raises(ValueError, match="group_gemm_swiglu_gather: row_src must have dtype int32"):
        ops.group_gemm_swiglu_gather(x, row_src.long(), w, slots, w, slots, cu, c.P, True)
    with pytest.raises(ValueError, match=r"group_gemm_wgrad_gather: dy must have shape"):
        ops.group_gemm_wgrad_gather(x, row_src[:-16], torch.zeros(c.NvS, c.F), cu, torch.zeros_like(w), slots, c.P)
    h_w = torch.zeros(c.NvS, c.F)
    with pytest.raises(ValueError, match="group_gemm_wgrad_gather_b: row_src must have one entry per row of x"):
        ops.group_gemm_wgrad_gather_b(h_w, x, row_src[:-16], cu, torch.zeros(c.epn, c.F, c.H),
                                      torch.zeros(c.B, c.F, c.H), c.P)


def _layer_step(cfg, group_kwargs, x0, g, n_tokens=None, compiled=False):
    """One forward + backward of a MoELayer (weights from seed 1) on a new group: y and every gradient."""
    torch.manual_seed(1)
    layer = MoELayer(EPGroup(cfg, **group_kwargs))
    x = x0.clone().requires_grad_()
    fn = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    y = fn(x) if n_tokens is None else fn(x, n_tokens)
    y.backward(g)
    return [y.detach(), x.grad, layer.router.weight.grad, *(p.grad for p in layer.experts.parameters())]


MODES = {"gathered": {}, "kept rows": dict(gather_rows=False, recompute_rows=False),
         "recomputed rows": dict(gather_rows=False, recompute_rows=True)}


@pytest.mark.parametrize("form", ["full", "padded", "n_tokens", "compiled"])
def test_gathered_layer_is_the_materialised_layer(gloo1, form):
    """EPGroup(gather_rows) (the R = 1 default): the layer's output and every gradient are bitwise those of
    the layer on dispatched rows (kept, or recomputed in backward), with the capacity's tokens, fewer
    (padded to S inside), the n_tokens form and under torch.compile(fullgraph=True)."""
    cfg = EPConfig(S=24, H=32, K=4, E=8, F=16, R=1, P=16)
    s = 17 if form == "padded" else cfg.S
    x0, g = torch.randn(s, cfg.H), torch.randn(s, cfg.H)
    n_tokens = 15 if form == "n_tokens" else None
    results = {mode: _layer_step(cfg, kw, x0, g, n_tokens, form == "compiled") for mode, kw in MODES.items()}
    names = ("y", "x", "router", "w_gate", "w_up", "w_down")
    for mode in ("kept rows", "recomputed rows"):
        for name, a, b in zip(names, results["gathered"], results[mode]):
            assert a.abs().sum() > 0 and torch.equal(a, b), (mode, name)


def test_gathered_inference_is_the_materialised_forward(gloo1):
    cfg = EPConfig(S=24, H=32, K=4, E=8, F=16, R=1, P=16)
    x = torch.randn(20, cfg.H)
    outs = []
    for kw in (MODES["gathered"], MODES["kept rows"]):
        torch.manual_seed(1)
        layer = MoELayer(EPGroup(cfg, **kw))
        with torch.no_grad():
            outs.append(layer(x))
    assert outs[0].abs().sum() > 0 and torch.equal(*outs)


def test_gather_rows_option(gloo1):
    """The default is the gathered path at R = 1; a non-bool is refused (recompute_rows' too); the gathered handle has no rows, so
    the experts without combine refuse it by name."""
    cfg = EPConfig(S=24, H=32, K=4, E=8, F=16, R=1, P=16)
    ep = EPGroup(cfg)
    assert ep.gather_rows is True and EPGroup(cfg, gather_rows=False).gather_rows is False
    assert ep.recompute_rows is True  # its default at R = 1 (None), for the materialised path
    for option in ("gather_rows", "recompute_rows"):
        with pytest.raises(ValueError, match=f"{option} must be a bool or None"):
            EPGroup(cfg, **{option: 1})
    layer = MoELayer(ep)
    x = torch.randn(cfg.S, cfg.H)
    route_w, ids = moonep_ops.route(layer.router(x), cfg.K)
    plan = ag.plan(ep, ids.int())
    dispatched = ag.dispatch_index(ep, x, route_w.float(), plan)
    assert dispatched.rows is None and dispatched.tokens is x and dispatched.row_src.shape == (cfg.NvS,)
    with pytest.raises(ValueError, match="MoEExperts: dispatched holds no rows"):
        layer.experts(dispatched, plan)
    with pytest.raises(ValueError, match="experts_combine: a Dispatch without rows must be the gathered form"):
        layer.experts(dispatched._replace(row_src=None), plan, combine=True)
