"""Single-rank checks of every moonep op: opcheck, values against plain torch, and bad inputs."""

import pytest
import torch
from torch.library import opcheck

import moonep_ops  # noqa: F401  (registers the ops)
from csrc_cute.status import control_words
from moonep_ops.config import EPConfig
from moonep_ops.group import MOONEP_OPS, EPGroup

ops = torch.ops.moonep
CFG = EPConfig(S=6, H=16, K=3, E=4, F=8, R=1, P=16)


def plan_of(ids, group):
    return ops.plan(ids, CFG.E, CFG.B, CFG.P, CFG.R, EPGroup(CFG).ctrl, group)


def ids_fixture():
    return torch.tensor([[0, 1, 2], [3, 0, 1], [2, 2, 0], [1, 3, 0], [0, 0, 0], [3, 2, 1]])




def op_cases(group, ids=None):
    """(op, args) for every op, with consistent real inputs at R=1 (routing `ids`, default
    ids_fixture()); and the EPGroup, which the caller keeps alive (the backward ops find it by key,
    and the registry holds it weakly)."""
    c = CFG
    ids = ids_fixture() if ids is None else ids
    dst_rank, dst_row, primary_row, etc, _, cu, group_rows, counts = plan_of(ids, group)
    x = torch.randn(c.S, c.H)
    route_w = torch.rand(c.S, c.K)
    ep = EPGroup(c, dtype=torch.float32)
    ep.alloc_weight_buffers()
    rows, row_w, row_primary, row_next = ops.dispatch(x, route_w, dst_rank, dst_row, primary_row, cu, group_rows,
                                                      *ep.dispatch_buffers, ep.ctrl, group)
    w_home, w_slot = torch.randn(c.epn, c.H, c.F), torch.randn(c.B, c.H, c.F)
    wd_home = torch.randn(c.epn, c.F, c.H)
    row_src = ep.recv_src.clone()  # R = 1: each row's token (-1: padding), the gathered ops' index
    hidden = torch.randn(c.NvS, c.F)
    pools = [torch.zeros(c.B, c.H, c.F), torch.zeros(c.B, c.H, c.F), torch.zeros(c.B, c.F, c.H)]
    return ep, {
        "plan": (ops.plan.default, (ids, c.E, c.B, c.P, c.R, ep.ctrl, group)),
        "dispatch": (ops.dispatch.default, (x, route_w, dst_rank, dst_row, primary_row, cu, group_rows,
                                            *ep.dispatch_buffers, ep.ctrl, group)),
        "combine": (ops.combine.default, (rows, row_primary, row_next, dst_rank, dst_row, primary_row, ep.presum,
                                          ep.ctrl, group)),
        "gather_row_weights": (ops.gather_row_weights.default, (row_w, dst_rank, dst_row, ep.row_scratch, ep.ctrl,
                                                                group)),
        "group_gemm": (ops.group_gemm.default, (rows, w_home, w_slot, cu, c.P)),
        "group_gemm_dgrad": (ops.group_gemm_dgrad.default, (hidden, w_home, w_slot, cu, c.P)),
        "group_gemm_dgrad2": (ops.group_gemm_dgrad2.default, (hidden, w_home, w_slot, hidden * 0.5, w_home * 2,
                                                              w_slot * 0.5, cu, c.P)),
        "group_gemm_wgrad": (ops.group_gemm_wgrad.default, (rows, hidden, cu, torch.zeros(c.epn, c.H, c.F),
                                                            torch.zeros(c.B, c.H, c.F), c.P)),
        "group_gemm_swiglu": (ops.group_gemm_swiglu.default, (rows, w_home, w_slot, w_home * 0.5, w_slot * 2, cu,
                                                              c.P, True)),
        "group_gemm_row_scale": (ops.group_gemm_row_scale.default, (hidden, wd_home, pools[2], cu, row_w.float(),
                                                                    c.P)),
        "group_gemm_swiglu_bwd": (ops.group_gemm_swiglu_bwd.default, (rows, wd_home, pools[2], cu, row_w.float(),
                                                                      hidden, hidden * 0.5, c.P)),
        "prefetch_weights": (ops.prefetch_weights.default, (w_home, w_home.clone(), wd_home, etc, *pools, ep.ctrl,
                                                            group)),
        "reduce_grad": (ops.reduce_grad.default, (etc, torch.randn(c.B, c.H, c.F), torch.randn(c.B, c.H, c.F),
                                                  torch.randn(c.B, c.F, c.H), torch.randn(c.epn, c.H, c.F),
                                                  torch.randn(c.epn, c.H, c.F), torch.randn(c.epn, c.F, c.H),
                                                  ep.ctrl, group)),
        # the gathered path (moonep_ops/ops_gathered.py): the tokens x by row_src in place of the rows
        "dispatch_index": (ops.dispatch_index.default, (x, route_w, dst_rank, dst_row, primary_row, cu, group_rows,
                                                        *ep.dispatch_buffers[1:], ep.ctrl, group)),
        "group_gemm_swiglu_gather": (ops.group_gemm_swiglu_gather.default, (x, row_src, w_home, w_slot, w_home * 0.5,
                                                                            w_slot * 2, cu, c.P, True)),
        "group_gemm_wgrad_gather": (ops.group_gemm_wgrad_gather.default, (x, row_src, hidden, cu,
                                                                          torch.zeros(c.epn, c.H, c.F),
                                                                          torch.zeros(c.B, c.H, c.F), c.P)),
        "group_gemm_wgrad_gather_b": (ops.group_gemm_wgrad_gather_b.default, (hidden, x, row_src, cu,
                                                                              torch.zeros(c.epn, c.F, c.H),
                                                                              torch.zeros(c.B, c.F, c.H), c.P)),
        "group_gemm_swiglu_bwd_gather": (ops.group_gemm_swiglu_bwd_gather.default, (
            x, row_src, wd_home, pools[2], cu, row_w.float(), hidden, hidden * 0.5, c.P)),
        # backward ops: they name the group by key and use its buffers (functional to the compiler)
        "combine_backward": (ops.combine_backward.default, (x, dst_rank, dst_row, primary_row, cu, group_rows,
                                                            ep.key)),
        "dispatch_backward": (ops.dispatch_backward.default, (rows, row_w, row_primary, row_next, dst_rank, dst_row,
                                                              primary_row, ep.key)),
        "experts_ffn_backward": (ops.experts_ffn_backward.default, (rows, rows * 0.5, row_w, w_home, w_home * 0.5,
                                                                    wd_home, cu, etc, hidden, hidden * 0.5, c.P,
                                                                    ep.key)),
        "experts_combine_backward": (ops.experts_combine_backward.default, (
            x, dst_rank, dst_row, primary_row, group_rows, rows * 0.5, None, row_w, w_home, w_home * 0.5, wd_home, cu,
            etc, hidden, hidden * 0.5, c.P, ep.key)),
        # EPGroup(recompute_rows): the tokens instead of the rows (dispatch(x * 0.5) is bitwise rows * 0.5)
        "experts_combine_backward_recompute": (ops.experts_combine_backward.default, (
            x, dst_rank, dst_row, primary_row, group_rows, None, x * 0.5, row_w, w_home, w_home * 0.5, wd_home, cu,
            etc, hidden, hidden * 0.5, c.P, ep.key)),
        "dispatch_index_backward": (ops.dispatch_index_backward.default, (row_w, dst_rank, dst_row, ep.key)),
        "experts_combine_gathered_backward": (ops.experts_combine_gathered_backward.default, (
            x, x * 0.5, row_src, row_primary, row_next, dst_rank, dst_row, primary_row, row_w, w_home, w_home * 0.5,
            wd_home, cu, hidden, hidden * 0.5, c.P, ep.key)),
    }


BACKWARD_OPS = ("combine_backward", "dispatch_backward", "experts_ffn_backward", "experts_combine_backward",
                "experts_combine_backward_recompute", "dispatch_index_backward", "experts_combine_gathered_backward")


@pytest.mark.parametrize("name", MOONEP_OPS + BACKWARD_OPS)
def test_opcheck(gloo1, name):
    ep, cases = op_cases(gloo1)
    op, args = cases[name]
    opcheck(op, args)


def test_dispatch_combine_values(gloo1):
    """Rows land at their planned rows, duplicates are copied locally, combine sums a token's K rows."""
    c = CFG
    ids = ids_fixture()
    dst_rank, dst_row, primary_row, _, _, cu, group_rows, _ = plan_of(ids, gloo1)
    x = torch.arange(c.S, dtype=torch.float32)[:, None].repeat(1, c.H) + 1  # row s holds s+1
    route_w = torch.arange(c.S * c.K, dtype=torch.float32).view(c.S, c.K) / 100
    ep = EPGroup(c, dtype=torch.float32)
    rows, row_w, row_primary, row_next = ops.dispatch(x, route_w, dst_rank, dst_row, primary_row, cu, group_rows,
                                                      *ep.dispatch_buffers, ep.ctrl, gloo1)
    assert torch.equal(ep.send_rows, x)  # staged for the peers
    for s in range(c.S):
        for k in range(c.K):
            r = int(dst_row[s, k])
            nxt = int(dst_row[s, k + 1]) if k + 1 < c.K else -1  # R=1: the next k is on the same rank
            assert torch.equal(rows[r], x[s]) and row_w[r] == route_w[s, k] and row_primary[r] == primary_row[s, k]
            assert row_next[r] == nxt and ep.recv_src[r] == s  # source: rank 0, token s
    padding = row_primary < 0
    assert int((~padding).sum()) == c.S * c.K and not rows[padding].any() and not row_w[padding].any()
    assert bool((row_next[padding] == -1).all())
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    real = torch.zeros(c.NvS, dtype=torch.bool)
    for s0, n in zip(starts.tolist(), group_rows.tolist()):
        real[s0:s0 + n] = True
    assert torch.equal(real, ~padding)  # group_rows locate exactly the real rows
    # on one rank all K rows of a token share a destination: exactly one carries it
    assert int((dst_row == primary_row).sum()) == c.S
    scale = torch.arange(c.NvS, dtype=torch.float32)[:, None]
    out = ops.combine(rows * scale, row_primary, row_next, dst_rank, dst_row, primary_row, ep.presum, ep.ctrl, gloo1)
    want = torch.stack([sum(x[s] * int(dst_row[s, k]) for k in range(c.K)) for s in range(c.S)])
    assert torch.equal(out, want)
    assert torch.equal(ops.gather_row_weights(row_w, dst_rank, dst_row, ep.row_scratch, ep.ctrl, gloo1), route_w)


def test_group_gemm_values():
    epn, B, Kd, Nd, P = 2, 2, 16, 8, 16
    cu = torch.tensor([16, 16, 48, 64], dtype=torch.int32)  # group 1 empty, group 2 two tiles, rows 64.. padding
    x = torch.randn(80, Kd)
    w_home, w_slot = torch.randn(epn, Kd, Nd), torch.randn(B, Kd, Nd)
    y = ops.group_gemm(x, w_home, w_slot, cu, P)
    torch.testing.assert_close(y[:16], x[:16] @ w_home[0])
    torch.testing.assert_close(y[16:48], x[16:48] @ w_slot[0])
    torch.testing.assert_close(y[48:64], x[48:64] @ w_slot[1])
    assert not y[64:].any()
    dy = torch.randn(80, Nd)
    dx = ops.group_gemm_dgrad(dy, w_home, w_slot, cu, P)
    torch.testing.assert_close(dx[16:48], dy[16:48] @ w_slot[0].t())
    assert not dx[64:].any()
    # dgrad2: both products summed in fp32, rounded once to the rows' dtype
    bf = torch.bfloat16
    dy_a, dy_b = (torch.randn(80, Nd).to(bf) for _ in range(2))
    wa_home, wa_slot, wb_home, wb_slot = (w.to(bf) for w in (w_home, w_slot, torch.randn(epn, Kd, Nd),
                                                              torch.randn(B, Kd, Nd)))
    dx2 = ops.group_gemm_dgrad2(dy_a, wa_home, wa_slot, dy_b, wb_home, wb_slot, cu, P)
    assert dx2.dtype == bf and dx2.shape == (80, Kd)
    for (s0, e0), wa, wb in (((0, 16), wa_home[0], wb_home[0]), ((16, 48), wa_slot[0], wb_slot[0]),
                             ((48, 64), wa_slot[1], wb_slot[1])):
        want = (dy_a[s0:e0].float() @ wa.float().t() + dy_b[s0:e0].float() @ wb.float().t()).to(bf)
        assert torch.equal(dx2[s0:e0], want)
    assert not dx2[64:].any()
    with pytest.raises(ValueError, match=r"moonep.group_gemm_dgrad2: dy_b must have shape \[80, 8\]"):
        ops.group_gemm_dgrad2(dy_a, wa_home, wa_slot, dy_b[:, :4].contiguous(), wb_home, wb_slot, cu, P)
    with pytest.raises(ValueError, match=r"moonep.group_gemm_dgrad2: w_b_slot must have shape \[2, 16, 8\]"):
        ops.group_gemm_dgrad2(dy_a, wa_home, wa_slot, dy_b, wb_home, wb_slot[:1], cu, P)
    # home groups are written (an empty one gets zeros), slot groups accumulate onto their fp32 content
    dw_home, dw_slot = torch.full((epn, Kd, Nd), float("nan")), torch.ones(B, Kd, Nd)
    ops.group_gemm_wgrad(x, dy, cu, dw_home, dw_slot, P)
    torch.testing.assert_close(dw_home[0], x[:16].t() @ dy[:16])
    assert torch.equal(dw_home[1], torch.zeros(Kd, Nd))
    torch.testing.assert_close(dw_slot[0], 1 + x[16:48].t() @ dy[16:48])
    torch.testing.assert_close(dw_slot[1], 1 + x[48:64].t() @ dy[48:64])
    # bf16 rows: the home gradient is the fp32 product rounded once; an empty slot group is untouched
    xb, dyb = x.bfloat16(), dy.bfloat16()
    cu2 = torch.tensor([16, 48, 48, 64], dtype=torch.int32)  # slot 0 empty
    hb, sb = torch.full((epn, Kd, Nd), float("nan"), dtype=torch.bfloat16), torch.ones(B, Kd, Nd)
    ops.group_gemm_wgrad(xb, dyb, cu2, hb, sb, P)
    assert torch.equal(hb[0], (xb[:16].float().t() @ dyb[:16].float()).bfloat16())
    assert torch.equal(hb[1], (xb[16:48].float().t() @ dyb[16:48].float()).bfloat16())
    assert torch.equal(sb[0], torch.ones(Kd, Nd))
    torch.testing.assert_close(sb[1], 1 + xb[48:64].float().t() @ dyb[48:64].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_grad_values(gloo1, dtype):
    """One rank whose slots hold copies of its own experts (a hand-made table): each home expert with
    copies becomes round(float(home) + its copies in rank order), the others are untouched; the used
    reduce slots are zeroed, the empty one kept."""
    epn, B, H, F = 3, 3, 16, 8
    cfg = EPConfig(S=4, H=H, K=1, E=epn, F=F, R=1, P=16)
    ctrl = EPGroup(cfg).ctrl
    etc = torch.tensor([[2, -1, 0]], dtype=torch.int32)  # slot 0: expert 2, slot 2: expert 0, slot 1 empty
    red = [torch.randn(B, H, F), torch.randn(B, H, F), torch.randn(B, F, H)]
    homes = [torch.randn(epn, H, F).to(dtype), torch.randn(epn, H, F).to(dtype), torch.randn(epn, F, H).to(dtype)]
    want = [h.clone() for h in homes]
    for w, r in zip(want, red):
        w[2] = (w[2].float() + r[0]).to(dtype)
        w[0] = (w[0].float() + r[2]).to(dtype)
    red_before = [r.clone() for r in red]
    ops.reduce_grad(etc, *red, *homes, ctrl, gloo1)
    for h, w, r, r0 in zip(homes, want, red, red_before):
        assert h.dtype == dtype and torch.equal(h, w)
        assert not r[0].any() and not r[2].any() and torch.equal(r[1], r0[1])


def test_group_gemm_swiglu_and_row_scale_values():
    epn, B, Kd, Nd, P = 2, 2, 16, 8, 16
    cu = torch.tensor([16, 16, 48, 64], dtype=torch.int32)
    x = torch.randn(80, Kd)
    wg_h, wg_s, wu_h, wu_s = torch.randn(epn, Kd, Nd), torch.randn(B, Kd, Nd), torch.randn(epn, Kd, Nd), torch.randn(
        B, Kd, Nd)
    h, gate, up = ops.group_gemm_swiglu(x, wg_h, wg_s, wu_h, wu_s, cu, P, True)
    for rows, wg, wu in ((slice(0, 16), wg_h[0], wu_h[0]), (slice(16, 48), wg_s[0], wu_s[0]),
                         (slice(48, 64), wg_s[1], wu_s[1])):
        torch.testing.assert_close(gate[rows], x[rows] @ wg)
        torch.testing.assert_close(up[rows], x[rows] @ wu)
        torch.testing.assert_close(h[rows], torch.nn.functional.silu(x[rows] @ wg) * (x[rows] @ wu))
    assert not h[64:].any() and not gate[64:].any() and not up[64:].any()
    h2, g2, u2 = ops.group_gemm_swiglu(x, wg_h, wg_s, wu_h, wu_s, cu, P, False)
    assert torch.equal(h2, h) and g2.shape == (0, Nd) and u2.shape == (0, Nd)
    # bf16: the activation uses the fp32 accumulators, not the rounded pre-activations
    xb, wgb, wub = x.bfloat16(), wg_h.bfloat16(), wu_h.bfloat16()
    hb, _, _ = ops.group_gemm_swiglu(xb, wgb, wgb[:0], wub, wub[:0], torch.tensor([16, 64], dtype=torch.int32), P, True)
    gf, uf = xb[:16].float() @ wgb[0].float(), xb[:16].float() @ wub[0].float()
    assert torch.equal(hb[:16], (torch.nn.functional.silu(gf) * uf).bfloat16())
    row_w = torch.rand(80)
    y = ops.group_gemm_row_scale(x, wg_h, wg_s, cu, row_w, P)
    torch.testing.assert_close(y[16:48], (x[16:48] @ wg_s[0]) * row_w[16:48, None])
    torch.testing.assert_close(y[:16], (x[:16] @ wg_h[0]) * row_w[:16, None])
    assert not y[64:].any()


def test_group_gemm_swiglu_bwd_is_the_gradient():
    """The fused backward equals autograd of y = ((silu(gate) * up) @ W_g) * row_w (fp32, CPU)."""
    epn, B, F, H, P = 2, 2, 8, 16, 16
    cu = torch.tensor([16, 16, 48, 64], dtype=torch.int32)
    n = 80
    wd_home, wd_slot = torch.randn(epn, F, H), torch.randn(B, F, H)
    gate, up, row_w = torch.randn(n, F, requires_grad=True), torch.randn(n, F, requires_grad=True), torch.rand(
        n, requires_grad=True)
    g_y = torch.randn(n, H)
    h = torch.nn.functional.silu(gate) * up
    y = ops.group_gemm_row_scale(h.detach(), wd_home, wd_slot, cu, row_w.detach(), P)
    ws = [wd_home[0], wd_home[1], wd_slot[0], wd_slot[1]]
    bounds = [(0, 16), (16, 16), (16, 48), (48, 64)]
    y_ref = torch.zeros(n, H)
    for (s, e), w in zip(bounds, ws):
        y_ref[s:e] = (h[s:e] @ w) * row_w[s:e, None]
    torch.testing.assert_close(y, y_ref.detach())
    (y_ref * g_y).sum().backward()
    g_gate, g_up, h_w, g_row_w = ops.group_gemm_swiglu_bwd(g_y, wd_home, wd_slot, cu, row_w.detach(), gate.detach(),
                                                           up.detach(), P)
    torch.testing.assert_close(g_gate, gate.grad)
    torch.testing.assert_close(g_up, up.grad)
    torch.testing.assert_close(g_row_w, row_w.grad)
    torch.testing.assert_close(h_w, h.detach() * row_w.detach()[:, None])
    # the down projection's weight gradient from h_w: dW_g = h_w_g^T g_y_g
    dw_home, dw_slot = torch.zeros(epn, F, H), torch.zeros(B, F, H)
    ops.group_gemm_wgrad(h_w, g_y, cu, dw_home, dw_slot, P)
    wl = [w.clone().requires_grad_(True) for w in ws]
    y2 = torch.zeros(n, H)
    for (s, e), w in zip(bounds, wl):
        y2[s:e] = (h.detach()[s:e] @ w) * row_w.detach()[s:e, None]
    (y2 * g_y).sum().backward()
    torch.testing.assert_close(dw_home[0], wl[0].grad)
    torch.testing.assert_close(dw_slot[0], wl[2].grad)
    torch.testing.assert_close(dw_slot[1], wl[3].grad)


# ------------------------------------------------------------------------------------- bad inputs
def bad_variants(t):
    """(what, replacement) for a tensor argument: wrong dtype, wrong shape, non-contiguous, wrong device."""
    wrong_dtype = t.to(torch.float64) if t.dtype != torch.float64 else t.to(torch.float32)
    yield "dtype", wrong_dtype
    yield "shape", t.unsqueeze(-1)
    if t.dim() >= 2 and t.shape[0] > 1 and t.shape[1] > 1:
        yield "contiguous", t.transpose(0, 1).contiguous().transpose(0, 1)
    yield "device", t.to("meta")


def all_bad_cases(group):
    ep, cases = op_cases(group)
    for name, (op, args) in cases.items():
        schema = op._schema
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.numel() > 0:
                for what, bad in bad_variants(a):
                    if what == "device" and i == 0:
                        continue  # the first tensor sets the device the others are checked against
                    yield name, schema.arguments[i].name, what, op, args[:i] + (bad,) + args[i + 1:]


def test_bad_inputs_name_the_argument(gloo1):
    checked = 0
    for name, arg, what, op, args in all_bad_cases(gloo1):
        with pytest.raises((ValueError, TypeError)) as info:
            op(*args)
        op_name = op._schema.name.removeprefix("moonep::")  # a case's name may be a variant of its op's
        assert f"moonep.{op_name}: {arg}" in str(info.value), (name, arg, what, str(info.value))
        checked += 1
    assert checked > 80


def test_expert_id_out_of_range(gloo1):
    ids = ids_fixture()
    ids[2, 1] = CFG.E
    with pytest.raises(ValueError, match=r"moonep.plan: topk_ids\[2, 1\] = 4 is outside \[0, E=4\)"):
        plan_of(ids, gloo1)
    ids[2, 1] = -2
    with pytest.raises(ValueError, match=r"topk_ids\[2, 1\] = -2 is outside \[0, E=4\) \(-1 marks an absent"):
        plan_of(ids, gloo1)
    ids[2, 1] = -1  # the absent marker in one of the token's K ids only
    with pytest.raises(ValueError, match=r"moonep.plan: topk_ids\[2\] = \[2, -1, 0\] mixes the absent-token marker"):
        plan_of(ids, gloo1)


def absent_ids():
    """ids_fixture with tokens 1 and 4 absent (all K ids -1)."""
    ids = ids_fixture()
    ids[[1, 4]] = -1
    return ids


def test_absent_tokens_are_neither_sent_nor_computed(gloo1):
    """Absent tokens (ids -1): destinations -1, no receive row, combine and gather_row_weights give 0;
    the present tokens' rows are those of the same tokens planned without the absent ones."""
    c = CFG
    ids = absent_ids()
    present = (ids >= 0).all(1)
    dst_rank, dst_row, primary_row, _, _, cu, group_rows, counts = plan_of(ids, gloo1)
    assert int(counts.sum()) == int(present.sum()) * c.K and int(group_rows.sum()) == int(counts.sum())
    for t in (dst_rank, dst_row, primary_row):
        assert bool((t[~present] == -1).all()) and bool((t[present] >= 0).all())
    x = torch.randn(c.S, c.H)
    route_w = torch.rand(c.S, c.K)
    ep = EPGroup(c, dtype=torch.float32)
    rows, row_w, row_primary, row_next = ops.dispatch(x, route_w, dst_rank, dst_row, primary_row, cu, group_rows,
                                                      *ep.dispatch_buffers, ep.ctrl, gloo1)
    assert int((row_primary >= 0).sum()) == int(present.sum()) * c.K  # only present tokens' rows are written
    assert set((ep.recv_src[ep.recv_src >= 0]).tolist()) == set(torch.nonzero(present).flatten().tolist())
    out = ops.combine(rows, row_primary, row_next, dst_rank, dst_row, primary_row, ep.presum, ep.ctrl, gloo1)
    torch.testing.assert_close(out[present], (x * c.K)[present])  # R=1: every k's row is x[s]
    assert not out[~present].any()
    got_w = ops.gather_row_weights(row_w, dst_rank, dst_row, ep.row_scratch, ep.ctrl, gloo1)
    assert torch.equal(got_w[present], route_w[present]) and not got_w[~present].any()


@pytest.mark.parametrize("name", ["plan", "dispatch", "combine", "gather_row_weights", "combine_backward",
                                  "dispatch_backward"])
def test_opcheck_with_absent_tokens(gloo1, name):
    ep, cases = op_cases(gloo1, absent_ids())
    op, args = cases[name]
    opcheck(op, args)


def test_dispatch_rejects_half_absent_rows(gloo1):
    c = CFG
    dst_rank, dst_row, primary_row, _, _, cu, group_rows, _ = plan_of(absent_ids(), gloo1)
    dst_row = dst_row.clone()
    dst_row[1, 0] = 0  # dst_rank -1 but a real row
    ep = EPGroup(c, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"moonep.dispatch: dst_rank\[1, 0\] = -1 is outside \[0, R=1\) \(-1 in every "
                                         r"table marks an absent token\)"):
        ops.dispatch(torch.randn(c.S, c.H), torch.rand(c.S, c.K), dst_rank, dst_row, primary_row, cu, group_rows,
                     *ep.dispatch_buffers, ep.ctrl, gloo1)


def test_remote_groups_read_the_home_ranks_weights(gloo1):
    """Inference groups after the slots: remote group j computes with expert experts_remote[j]'s home
    weights (here R=1, so this rank's own), -1 is an empty group; both fused ops, values and opcheck;
    and the arguments are checked by name."""
    epn, B, Kd, Nd, P = 3, 1, 16, 8, 16
    wg_h, wu_h, wd_h = torch.randn(epn, Kd, Nd), torch.randn(epn, Kd, Nd), torch.randn(epn, Nd, Kd)
    wg_s, wu_s, wd_s = torch.randn(B, Kd, Nd), torch.randn(B, Kd, Nd), torch.randn(B, Nd, Kd)
    remote = torch.tensor([2, 0, -1], dtype=torch.int32)
    cu = torch.tensor([16, 16, 16, 32, 48, 80, 80], dtype=torch.int32)  # home 0, slot 0, remote 2 and 0
    x = torch.randn(96, Kd)
    h, _, _ = ops.group_gemm_swiglu(x, wg_h, wg_s, wu_h, wu_s, cu, P, False, remote, gloo1)
    row_w = torch.rand(96)
    y = ops.group_gemm_row_scale(x[:, :Nd].contiguous(), wd_h, wd_s, cu, row_w, P, remote, gloo1)
    for rows, e in ((slice(0, 16), 0), (slice(32, 48), 2), (slice(48, 80), 0)):
        torch.testing.assert_close(h[rows], torch.nn.functional.silu(x[rows] @ wg_h[e]) * (x[rows] @ wu_h[e]))
        torch.testing.assert_close(y[rows], (x[rows, :Nd] @ wd_h[e]) * row_w[rows, None])
    torch.testing.assert_close(h[16:32], torch.nn.functional.silu(x[16:32] @ wg_s[0]) * (x[16:32] @ wu_s[0]))
    assert not h[80:].any() and not y[80:].any()
    opcheck(ops.group_gemm_swiglu.default, (x, wg_h, wg_s, wu_h, wu_s, cu, P, True, remote, gloo1))
    opcheck(ops.group_gemm_row_scale.default, (x[:, :Nd].contiguous(), wd_h, wd_s, cu, row_w, P, remote, gloo1))
    with pytest.raises(ValueError, match=r"moonep.group_gemm_swiglu: experts_remote must have dtype int32"):
        ops.group_gemm_swiglu(x, wg_h, wg_s, wu_h, wu_s, cu, P, False, remote.long(), gloo1)
    with pytest.raises(ValueError, match=r"moonep.group_gemm_row_scale: cu_seqlens must have shape \[6\]"):
        ops.group_gemm_row_scale(x[:, :Nd].contiguous(), wd_h, wd_s, cu, row_w, P, remote[:2], gloo1)
    with pytest.raises(ValueError, match=r"experts_remote needs group_name"):
        ops.group_gemm_swiglu(x, wg_h, wg_s, wu_h, wu_s, cu, P, False, remote)


def test_group_gemm_rejects_bad_groups():
    x, w = torch.randn(64, 8), torch.randn(2, 8, 8)
    with pytest.raises(ValueError, match=r"moonep.group_gemm: cu_seqlens must be non-decreasing multiples of P=16"):
        ops.group_gemm(x, w, w, torch.tensor([16, 8, 32, 32], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match=r"multiples of P=16, got \[16, 24"):
        ops.group_gemm(x, w, w, torch.tensor([16, 24, 32, 32], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 80 but there are only 64 rows"):
        ops.group_gemm(x, w, w, torch.tensor([16, 32, 48, 80], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match=r"moonep.group_gemm: P must be a power of two >= 16"):
        ops.group_gemm(x, w, w, torch.tensor([16, 32, 48, 64], dtype=torch.int32), 24)


def test_int32_and_int64_ids_agree(gloo1):
    a = plan_of(ids_fixture(), gloo1)
    b = plan_of(ids_fixture().int(), gloo1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_plan_rejects_wrong_R(gloo1):
    with pytest.raises(ValueError, match=r"moonep.plan: R=2 but process group"):
        ops.plan(torch.zeros(4, 1, dtype=torch.long), 4, 2, 16, 2, torch.zeros(control_words(2, 4), dtype=torch.int32),
                 gloo1)


def test_experts_combine_backward_is_the_two_backwards_in_a_row(gloo1):
    """The fused op (one autograd Function for the experts and the combine) returns bitwise what
    combine_backward then experts_ffn_backward return: the same ops on the same inputs; and so does it
    with the rows dispatched again from the tokens (EPGroup(recompute_rows))."""
    ep, cases = op_cases(gloo1)
    g_out, dst_rank, dst_row, primary_row, group_rows, rows, _, *saved, P, key = cases["experts_combine_backward"][1]
    tokens = cases["experts_combine_backward_recompute"][1][6]
    plan = (dst_rank, dst_row, primary_row, group_rows)
    row_w, w_gate, w_up, w_down, cu, etc, gate, up = saved
    fused = ops.experts_combine_backward(g_out, *plan, rows, None, *saved, P, key)
    recomputed = ops.experts_combine_backward(g_out, *plan, None, tokens, *saved, P, key)
    g_y = ops.combine_backward(g_out, dst_rank, dst_row, primary_row, cu, group_rows, key)
    assert g_y.abs().sum() > 0  # the routed rows carry their token's gradient
    two = ops.experts_ffn_backward(g_y, rows, *saved, P, key)
    for name, a, b, c in zip(("g_rows", "g_row_w", "dw_gate", "dw_up", "dw_down"), fused, two, recomputed):
        assert torch.equal(a, b) and torch.equal(a, c), name
        assert a.abs().sum() > 0, name
    with pytest.raises(ValueError, match=r"moonep.experts_combine_backward: g_out must have shape \[6, 16\]"):
        ops.experts_combine_backward(g_out[:4], *plan, rows, None, *saved, P, key)
    for given, what in (((rows, tokens), "both"), ((None, None), "neither")):
        with pytest.raises(ValueError, match=r"moonep.experts_combine_backward: exactly one of rows \(the dispatched "
                                             rf"rows\) and tokens .* must be given, got {what}"):
            ops.experts_combine_backward(g_out, *plan, *given, *saved, P, key)
    with pytest.raises(ValueError, match=r"moonep.experts_combine_backward: tokens must have shape \[6, 16\]"):
        ops.experts_combine_backward(g_out, *plan, None, rows, *saved, P, key)


def test_backward_op_with_a_dead_group_key(gloo1):
    """The backward ops hold their group weakly (by key): a destroyed group is an error naming the key."""
    ep, cases = op_cases(gloo1)
    op, args = cases["combine_backward"]
    ep.destroy()
    with pytest.raises(ValueError, match=r"moonep.combine_backward: ep_key='0/\d+' names no live EPGroup"):
        op(*args)


def _autograd_nodes(t: torch.Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node.name() in seen:
            continue
        seen.add(node.name())
        todo.extend(n for n, _ in node.next_functions)
    return seen


def test_eager_full_batch_neither_pads_nor_slices(gloo1):
    """An eager MoELayer call with s = S tokens runs no pad and no slice (each a copy of x's size, with a
    backward twin); with s < S it pads to S and slices the output back, and both give the dense result."""
    from moonep_ops import MoELayer

    ep = EPGroup(CFG, dtype=torch.float32)
    layer = MoELayer(ep)
    copies = {"ConstantPadNdBackward0", "SliceBackward0"}
    for s in (CFG.S, CFG.S - 2):
        x = torch.randn(s, CFG.H, requires_grad=True)
        y = layer(x)
        nodes = _autograd_nodes(y)
        assert (copies & nodes) == (set() if s == CFG.S else copies), (s, sorted(nodes))
        w, ids = torch.softmax(layer.router(x), 1).topk(CFG.K, dim=1)
        w = w / w.sum(1, keepdim=True)
        ex = layer.experts
        dense = sum(w[:, k, None] * torch.stack([
            (torch.nn.functional.silu(x[i] @ ex.w_gate[e]) * (x[i] @ ex.w_up[e])) @ ex.w_down[e]
            for i, e in enumerate(ids[:, k].tolist())]) for k in range(CFG.K))
        torch.testing.assert_close(y, dense, rtol=1e-4, atol=1e-5)
    ep.destroy()
