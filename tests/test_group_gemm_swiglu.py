"""GPU (Hopper) tests of the fused SwiGLU kernels: gate/up + SwiGLU (group_gemm_swiglu, with and without
the stored pre-activations; group_gemm_swiglu_gather, its rows gathered from x by index, bitwise against it)
and the SwiGLU backward fused into the down projection's dgrad
(group_gemm_swiglu_bwd; group_gemm_swiglu_bwd_gather, its g_y rows gathered from g_out by index, bitwise
against it), against the CPU reference ops and torch autograd; the registered ops and CUDA
graphs of the fused FFN forward (with the row-scaled down projection) and backward. Skipped without a
Hopper GPU.
"""

import pytest
import torch

import moonep_ops  # noqa: F401  (registers moonep::group_gemm*, the reference ops)
from group_gemm_cases import (
    WGRAD_HOME_TOL,
    WGRAD_TOL,
    capture_graph,
    check_rows,
    check_swiglu,
    gathered_rows,
    gpu,
    nan_home_grads,
    random_lengths,
    random_problem,
    random_routing,
    random_row_src,
    random_swiglu_problem,
    random_tokens,
    reference_swiglu,
    zero_swiglu_inputs,
)


# ------------------------------------------------------------------------------------------------
# gate/up + SwiGLU (group_gemm_swiglu)
# ------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("pad", [128, 64, 256])
def test_swiglu_random_groups_with_empty_and_slots(pad):
    # H = 520: partial k tile; F = 200: partial n tile (128 columns of h per tile)
    lengths = random_lengths(pad, 5, 4, 6, seed=40 + pad)
    args = random_swiglu_problem(lengths, 5, kd=520, nd=200, n_total=sum(lengths) + 3 * pad, seed=pad)
    check_swiglu(*args, pad=pad)


@gpu
def test_swiglu_many_tiles_h_only_and_one_group():
    lengths = random_lengths(128, 8, 8, 13, seed=77)
    args = random_swiglu_problem(lengths, 8, kd=256, nd=1024, n_total=sum(lengths) + 5 * 128, seed=77)
    h, _, _ = check_swiglu(*args)
    h_only, _, _ = check_swiglu(*args, store_preact=False)
    assert torch.equal(h, h_only)
    for lengths, epn in (([0, 0, 1024, 0], 3), ([0, 0, 0, 1024], 3), ([128] * 6, 6)):  # one group / B = 0 / 1 tile
        check_swiglu(*random_swiglu_problem(lengths, epn, kd=384, nd=256, n_total=sum(lengths) + 128, seed=len(lengths)))


@gpu
def test_swiglu_slot_weights_are_read_from_the_slot_pools():
    # slot gate weights negated, slot up weights swapped with home gate: a mix-up changes h
    x, wgh, wgs, wuh, wus, cu = random_swiglu_problem([256, 256], 1, kd=128, nd=128, seed=5)
    wgs.copy_(-wgh)
    wus.copy_(wgh)
    h, gate, up = check_swiglu(x, wgh, wgs, wuh, wus, cu)
    g = -(x[256:].float() @ wgh[0].float())
    u = x[256:].float() @ wgh[0].float()
    torch.testing.assert_close(h[256:].float(), (torch.nn.functional.silu(g) * u).bfloat16().float(),
                               atol=2e-2, rtol=2e-2)


@gpu
def test_swiglu_and_row_scale_registered_ops_and_cuda_graph():
    from csrc_cute.group_gemm import group_gemm_row_scale, group_gemm_swiglu

    epn, nb, kd, nd, n = 4, 2, 384, 256, 2048
    x, wgh, wgs, wuh, wus, _ = random_swiglu_problem([0] * (epn + nb), epn, kd, nd, n_total=n, seed=3)
    _, wdh, wds, _ = random_problem([0] * (epn + nb), epn, nd, kd, n_total=n, seed=4)
    row_w = torch.rand(n, device="cuda")
    cu = torch.zeros(epn + nb, dtype=torch.int32, device="cuda")
    cu.copy_(random_routing(epn, nb, n, 0))
    # the registered ops run these kernels (bitwise)
    h, gate, up = torch.ops.moonep.group_gemm_swiglu(x, wgh, wgs, wuh, wus, cu, 128, True)
    h2, g2, u2 = group_gemm_swiglu(x, wgh, wgs, wuh, wus, cu)
    assert torch.equal(h, h2) and torch.equal(gate, g2) and torch.equal(up, u2)
    h3, g3, u3 = torch.ops.moonep.group_gemm_swiglu(x, wgh, wgs, wuh, wus, cu, 128, False)
    assert torch.equal(h3, h) and g3.shape == (0, nd) and u3.shape == (0, nd)
    y = torch.ops.moonep.group_gemm_row_scale(h, wdh, wds, cu, row_w, 128)
    assert torch.equal(y, group_gemm_row_scale(h, wdh, wds, cu, row_w))
    # capture the fused FFN forward (swiglu -> row-scaled down) once, replay with new routings
    bufs = [torch.empty(n, nd, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    y_out = torch.empty(n, kd, dtype=torch.bfloat16, device="cuda")
    graph = capture_graph(lambda: (
        group_gemm_swiglu(x, wgh, wgs, wuh, wus, cu, out=bufs[0], gate_out=bufs[1], up_out=bufs[2]),
        group_gemm_row_scale(bufs[0], wdh, wds, cu, row_w, out=y_out)))
    for seed in range(1, 4):
        cu.copy_(random_routing(epn, nb, n, seed))
        for b in bufs + [y_out]:
            b.fill_(float("nan"))
        graph.replay()
        eh, eg, eu = group_gemm_swiglu(x, wgh, wgs, wuh, wus, cu)
        ey = group_gemm_row_scale(eh, wdh, wds, cu, row_w)
        torch.cuda.synchronize()
        assert torch.equal(bufs[0], eh) and torch.equal(bufs[1], eg) and torch.equal(bufs[2], eu), seed
        assert torch.equal(y_out, ey), seed
        ref_h, ref_g, _ = reference_swiglu(x, wgh, wgs, wuh, wus, cu)
        check_rows(bufs[0], ref_h, cu)
        check_rows(bufs[1], ref_g, cu)


# ------------------------------------------------------------------------------------------------
# gate/up + SwiGLU with A gathered from x by row index (group_gemm_swiglu_gather)
# ------------------------------------------------------------------------------------------------


def check_swiglu_gather(x, row_src, wgh, wgs, wuh, wus, cu, pad=128, store_preact=True):
    """The gathered kernel bitwise against ``group_gemm_swiglu`` on the gathered rows (outputs pre-filled
    with NaN: every row must be written)."""
    from csrc_cute.group_gemm import group_gemm_swiglu, group_gemm_swiglu_gather

    n, nd = row_src.shape[0], wgh.shape[2]
    bufs = [torch.full((n, nd), float("nan"), dtype=torch.bfloat16, device=x.device) for _ in range(3)]
    got = group_gemm_swiglu_gather(x, row_src, wgh, wgs, wuh, wus, cu, pad=pad, store_preact=store_preact,
                                   out=bufs[0], gate_out=bufs[1], up_out=bufs[2])
    want = group_gemm_swiglu(gathered_rows(x, row_src), wgh, wgs, wuh, wus, cu, pad=pad, store_preact=store_preact)
    torch.cuda.synchronize()
    for name, a, b in zip(("h", "gate", "up"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == (n, nd), (name, a.shape)
        assert torch.equal(a, b), f"{name} differs in {(a != b).any(1).sum().item()} rows"
    if not store_preact:
        assert torch.isnan(bufs[1]).all() and torch.isnan(bufs[2]).all(), "h-only kernel wrote gate/up"
    return got


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_swiglu_gather_equals_swiglu_on_gathered_rows(pad):
    # H = 520: partial last k tile (chunks past H zero-filled); F = 200: partial n tile; empty groups,
    # an all-padding group, padding in every group, rows past the last group, token S - 1, repeats
    lengths = random_lengths(pad, 5, 4, 6, seed=60 + pad)
    lengths[2] = max(lengths[2], pad)
    _, wgh, wgs, wuh, wus, cu = random_swiglu_problem(lengths, 5, kd=520, nd=200, seed=pad)
    n = sum(lengths) + 3 * pad
    x = random_tokens(301, 520, seed=pad + 1)
    for seed, tail_valid in ((0, False), (1, True)):
        row_src = random_row_src(cu, n, x.shape[0], seed, all_padding=(2,), tail_valid=tail_valid)
        check_swiglu_gather(x, row_src, wgh, wgs, wuh, wus, cu, pad=pad)
    h, _, _ = check_swiglu_gather(x, row_src, wgh, wgs, wuh, wus, cu, pad=pad)
    h_only, _, _ = check_swiglu_gather(x, row_src, wgh, wgs, wuh, wus, cu, pad=pad, store_preact=False)
    assert torch.equal(h, h_only)
    # N < S, one group, B = 0 (the slot map stands in for the empty slots)
    lengths = [0, 2 * pad, 0]
    _, wgh, wgs, wuh, wus, cu = random_swiglu_problem(lengths, 3, kd=256, nd=128, seed=pad + 2)
    check_swiglu_gather(x[:, :256].contiguous(), random_row_src(cu, 2 * pad, 301, 2), wgh, wgs, wuh, wus, cu, pad=pad)
    # no tokens at all (S = 0): every row is padding, h = silu(0) * 0 = 0
    none = torch.full((2 * pad,), -1, dtype=torch.int32, device="cuda")
    h, gate, _ = check_swiglu_gather(x[:0, :256], none, wgh, wgs, wuh, wus, cu, pad=pad)
    assert not h.any() and not gate.any()


@gpu
def test_swiglu_gather_design_shape():
    # H = 7168, F = 2048, ~65k rows from S = 8192 tokens (K = 8 routed rows a token), 8 home + 2 slot groups
    epn, nb, pad = 8, 2, 128
    lengths = random_lengths(pad, epn, nb, 100, seed=9)
    _, wgh, wgs, wuh, wus, cu = random_swiglu_problem(lengths, epn, kd=7168, nd=2048, n_total=pad, seed=9)
    n = sum(lengths) + 2 * pad
    assert n > 40_000, n
    x = random_tokens(8192, 7168, seed=10)
    check_swiglu_gather(x, random_row_src(cu, n, x.shape[0], 11, all_padding=(3,)), wgh, wgs, wuh, wus, cu)


@gpu
def test_swiglu_gather_cuda_graph_replay():
    from csrc_cute.group_gemm import group_gemm_swiglu_gather

    epn, nb, kd, nd, n, s = 4, 2, 384, 256, 2048, 700
    _, wgh, wgs, wuh, wus, _ = random_swiglu_problem([0] * (epn + nb), epn, kd, nd, n_total=128, seed=21)
    x = random_tokens(s, kd, seed=22)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device="cuda")
    row_src = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    bufs = [torch.empty(n, nd, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    cu.copy_(random_routing(epn, nb, n, 0))
    row_src.copy_(random_row_src(cu, n, s, 0))
    check_swiglu_gather(x, row_src, wgh, wgs, wuh, wus, cu)  # compiled before the capture
    graph = capture_graph(lambda: group_gemm_swiglu_gather(x, row_src, wgh, wgs, wuh, wus, cu, out=bufs[0],
                                                           gate_out=bufs[1], up_out=bufs[2]))
    for seed in range(1, 4):
        cu.copy_(random_routing(epn, nb, n, seed))
        row_src.copy_(random_row_src(cu, n, s, seed, tail_valid=seed == 2))
        for b in bufs:
            b.fill_(float("nan"))
        graph.replay()
        want = check_swiglu_gather(x, row_src, wgh, wgs, wuh, wus, cu)
        assert all(torch.equal(a, b) for a, b in zip(bufs, want)), seed


def test_swiglu_gather_rejects_bad_row_src():
    """The host checks of row_src and the weights (before any device check: CPU tensors suffice)."""
    from csrc_cute.group_gemm import group_gemm_swiglu_gather

    x, wgh, wgs, wuh, wus, cu = zero_swiglu_inputs()
    for bad, rule in ((torch.zeros(256, dtype=torch.int64), "dtype int32"),
                      (torch.zeros(16, 16, dtype=torch.int32), "shape"),
                      (torch.zeros(512, dtype=torch.int32)[::2], "contiguous"),
                      (torch.zeros(256), "dtype int32")):
        with pytest.raises(ValueError, match=f"group_gemm_swiglu_gather: row_src must .*{rule}"):
            group_gemm_swiglu_gather(x, bad, wgh, wgs, wuh, wus, cu)
    with pytest.raises(ValueError, match="group_gemm_swiglu_gather: x must be a CUDA tensor"):
        group_gemm_swiglu_gather(x, torch.zeros(256, dtype=torch.int32), wgh, wgs, wuh, wus, cu)
    # the weights' contract is group_gemm_swiglu's, its errors naming the gathered op
    with pytest.raises(ValueError, match="group_gemm_swiglu_gather: w_up_home must be bfloat16"):
        group_gemm_swiglu_gather(x, torch.zeros(256, dtype=torch.int32), wgh, wgs, wuh.float(), wus, cu)


# ------------------------------------------------------------------------------------------------
# SwiGLU backward fused into the down projection's dgrad (group_gemm_swiglu_bwd)
# ------------------------------------------------------------------------------------------------


def _make_swiglu_bwd(lengths, epn, hd, f, n_total=None, seed=0):
    """(g_y [N, H], w_down_home [epn, F, H], w_down_slot, cu, row_w [N], gate [N, F], up [N, F]) on the GPU."""
    g_y, wdh, wds, cu = random_problem(lengths, epn, f, hd, n_total=n_total, seed=seed)  # weights [*, F, H]
    gen = torch.Generator().manual_seed(seed + 77)
    n = g_y.shape[0]
    g_y = torch.randn(n, hd, generator=gen).bfloat16().cuda()
    wdh.mul_((f / hd) ** 0.5)
    wds.mul_((f / hd) ** 0.5)
    gate = (torch.randn(n, f, generator=gen) * 2).bfloat16().cuda()
    up = torch.randn(n, f, generator=gen).bfloat16().cuda()
    row_w = torch.rand(n, generator=gen).cuda()
    return g_y, wdh, wds, cu, row_w, gate, up


def reference_swiglu_bwd(*args, pad=128):
    out = torch.ops.moonep.group_gemm_swiglu_bwd(*(t.cpu() for t in args), pad)
    return tuple(t.to(args[0].device) for t in out)


def _check_swiglu_bwd(args, pad=128):
    """The kernel (its default shared-memory epilogue) against the CPU reference, and bitwise equal to its register
    epilogue (the route-weight gradient within fp32 rounding where the two run different tiles: where the HBM is
    slow the shared-memory epilogue's tile may be 192 columns wide, whose partial sums cover other columns)."""
    from csrc_cute.group_gemm import group_gemm_swiglu_bwd
    from csrc_cute.group_gemm.host import _device_info, swiglu_bwd_op_config

    got = group_gemm_swiglu_bwd(*args, pad=pad)  # the default: the shared-memory epilogue
    registers = group_gemm_swiglu_bwd(*args, pad=pad, epilogue="registers")
    ref = reference_swiglu_bwd(*args, pad=pad)
    torch.cuda.synchronize()
    f, (_, num_sms, hbm_gbs) = args[5].shape[1], _device_info(args[5].device)
    tiles = {swiglu_bwd_op_config(op, pad, f, num_sms, hbm_gbs).tile_n for op in ("swiglu_bwd", "swiglu_bwd_smem")}
    same_tile = len(tiles) == 1
    for name, a, b in zip(("g_gate", "g_up", "h_w", "g_row_w"), got, registers):
        if name == "g_row_w" and not same_tile:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
        else:
            assert torch.equal(a, b), \
                f"epilogue='registers' {name} differs: {(a.float() - b.float()).abs().max().item()}"
    for name, a, b in zip(("g_gate", "g_up", "h_w"), got[:3], ref[:3]):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")
    # g_row_w sums F products of order one: compare relative to the row's scale
    torch.testing.assert_close(got[3], ref[3], atol=2e-2 * args[5].shape[1] ** 0.5, rtol=2e-2)
    end = int(args[3][-1])
    assert torch.count_nonzero(got[0][end:]) == 0 and torch.count_nonzero(got[3][end:]) == 0
    return got


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_swiglu_bwd_random_groups_with_empty_and_slots(pad):
    # H = 520: partial k tile; F = 200: partial output tile; padding rows past the last group
    lengths = random_lengths(pad, 5, 4, 6, seed=90 + pad)
    _check_swiglu_bwd(_make_swiglu_bwd(lengths, 5, hd=520, f=200, n_total=sum(lengths) + 3 * pad, seed=pad), pad)


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_swiglu_bwd_160_column_tiles_with_a_partial_last_tile(pad):
    # F = 1568 = 9 x 160 + 128: the 160-column tile (select_swiglu_bwd_config), whose last n tile is
    # partial, next to partial m tiles (rows past the last group)
    from csrc_cute.group_gemm import select_swiglu_bwd_config

    assert select_swiglu_bwd_config(pad, 1568).tile_n == 160
    lengths = random_lengths(pad, 4, 2, 5, seed=95 + pad)
    _check_swiglu_bwd(_make_swiglu_bwd(lengths, 4, hd=320, f=1568, n_total=sum(lengths) + pad + 32, seed=95), pad)


@gpu
def test_swiglu_bwd_many_tiles_one_group_and_slot_pool():
    lengths = random_lengths(128, 8, 8, 13, seed=91)
    _check_swiglu_bwd(_make_swiglu_bwd(lengths, 8, hd=512, f=1024, n_total=sum(lengths) + 256, seed=91))
    for lengths, epn in (([0, 0, 1024, 0], 3), ([0, 0, 0, 1024], 3), ([128, 0, 256], 3)):
        _check_swiglu_bwd(_make_swiglu_bwd(lengths, epn, hd=256, f=384, n_total=sum(lengths) + 128, seed=92))
    # slot weights negated: g_gate, g_up and g_row_w of the slot rows flip sign, h_w does not
    args = list(_make_swiglu_bwd([256, 256], 1, hd=128, f=128, seed=93))
    args[2] = -args[1]
    got = _check_swiglu_bwd(tuple(args))
    flipped = list(args)
    flipped[2] = args[1].clone()
    ref = reference_swiglu_bwd(*flipped)
    torch.testing.assert_close(got[0][256:].float(), -ref[0][256:].float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got[2].float(), ref[2].float(), atol=3e-2, rtol=2e-2)


@gpu
def test_swiglu_bwd_op_autograd_chain_and_cuda_graph():
    """The registered op runs the kernel, and the whole fused FFN backward (this kernel, the dgrads and
    wgrads) matches torch autograd of the fp32 math; then capture + replay with new routings."""
    from csrc_cute.group_gemm import group_gemm_swiglu_bwd

    epn, nb, hd, f, n = 3, 2, 256, 384, 1536
    g_y, wdh, wds, _, row_w, gate, up = _make_swiglu_bwd([0] * (epn + nb), epn, hd, f, n_total=n, seed=94)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device="cuda")
    cu.copy_(random_routing(epn, nb, n, 0))
    got = torch.ops.moonep.group_gemm_swiglu_bwd(g_y, wdh, wds, cu, row_w, gate, up, 128)
    again = group_gemm_swiglu_bwd(g_y, wdh, wds, cu, row_w, gate, up)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "not deterministic / not the kernel"
    # autograd of y = ((silu(gate) * up) @ W_g) * row_w in fp32 on the CPU
    leaves = [t.detach().cpu().float().requires_grad_(True) for t in (gate, up, row_w)]
    w_all = torch.cat([wdh, wds]).cpu().float()
    cu_l = [0] + cu.cpu().tolist()
    h = torch.nn.functional.silu(leaves[0]) * leaves[1]
    y = torch.zeros(n, hd)
    for g in range(epn + nb):
        y[cu_l[g]:cu_l[g + 1]] = h[cu_l[g]:cu_l[g + 1]] @ w_all[g]
    (y * leaves[2][:, None] * g_y.cpu().float()).sum().backward()
    for name, a, b in (("g_gate", got[0], leaves[0].grad), ("g_up", got[1], leaves[1].grad)):
        torch.testing.assert_close(a.float().cpu(), b, atol=3e-2, rtol=3e-2, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(got[3].cpu(), leaves[2].grad, atol=0.2, rtol=2e-2)
    # down projection's weight gradient from h_w: dW_g = h_w_g^T g_y_g
    from csrc_cute.group_gemm import group_gemm_wgrad

    # (h_w itself is checked against the fp32 reference above; here the bf16 h_w the kernel wrote is the
    # operand, so only the fp32 summation order differs; against fp32 h the bf16 rounding of h_w, summed
    # over a group's rows, exceeds atol 0.1 already with the CPU reference's h_w)
    dwh, dws = nan_home_grads(epn, f, hd), torch.zeros(nb, f, hd, device="cuda")
    group_gemm_wgrad(got[2], g_y, cu, dwh, dws)
    hw = got[2].cpu().float()
    for g in range(epn + nb):
        ref = hw[cu_l[g]:cu_l[g + 1]].t() @ g_y.cpu().float()[cu_l[g]:cu_l[g + 1]]
        if g < epn:  # home: bf16, written
            torch.testing.assert_close(dwh[g].float().cpu(), ref, **WGRAD_HOME_TOL)
        else:
            torch.testing.assert_close(dws[g - epn].cpu(), ref, **WGRAD_TOL)
    # CUDA graph: capture once, replay with new routings on the device
    outs = [torch.empty_like(t) for t in got]

    def bwd_into_outs():
        for o, r in zip(outs, group_gemm_swiglu_bwd(g_y, wdh, wds, cu, row_w, gate, up)):
            o.copy_(r)

    graph = capture_graph(bwd_into_outs)
    for seed in range(1, 4):
        cu.copy_(random_routing(epn, nb, n, seed))
        graph.replay()
        eager = group_gemm_swiglu_bwd(g_y, wdh, wds, cu, row_w, gate, up)
        torch.cuda.synchronize()
        assert all(torch.equal(o, e) for o, e in zip(outs, eager)), seed
        _check_swiglu_bwd((g_y, wdh, wds, cu, row_w, gate, up))


# ------------------------------------------------------------------------------------------------
# SwiGLU backward with g_y gathered from g_out by row index (group_gemm_swiglu_bwd_gather)
# ------------------------------------------------------------------------------------------------


def check_swiglu_bwd_gather(g_out, row_src, wdh, wds, cu, row_w, gate, up, pad=128):
    """The gathered kernel bitwise against ``group_gemm_swiglu_bwd`` (its default shared-memory epilogue)
    on the gathered rows ``g_y = where(row_src >= 0, g_out[row_src], 0)``; returns its outputs."""
    from csrc_cute.group_gemm import group_gemm_swiglu_bwd, group_gemm_swiglu_bwd_gather

    got = group_gemm_swiglu_bwd_gather(g_out, row_src, wdh, wds, cu, row_w, gate, up, pad=pad)
    want = group_gemm_swiglu_bwd(gathered_rows(g_out, row_src), wdh, wds, cu, row_w, gate, up, pad=pad)
    torch.cuda.synchronize()
    for name, a, b in zip(("g_gate", "g_up", "h_w", "g_row_w"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.equal(a, b), f"{name} differs in {(a != b).reshape(a.shape[0], -1).any(1).sum().item()} rows"
    return got


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_swiglu_bwd_gather_equals_swiglu_bwd_on_gathered_rows(pad):
    # H = 520: partial last k tile (chunks past H zero-filled); F = 200: partial n tile; empty home and slot
    # groups, an all-padding group, padding rows in every group, rows past the last group (padding or
    # valid tokens), token S - 1, a token in several groups and repeated within one
    lengths = random_lengths(pad, 5, 4, 6, seed=100 + pad)
    lengths[2] = max(lengths[2], pad)
    n = sum(lengths) + 3 * pad
    _, wdh, wds, cu, row_w, gate, up = _make_swiglu_bwd(lengths, 5, hd=520, f=200, n_total=n, seed=pad)
    g_out = random_tokens(301, 520, seed=pad + 7)
    for seed, tail_valid in ((0, False), (1, True)):
        row_src = random_row_src(cu, n, g_out.shape[0], seed, all_padding=(2,), tail_valid=tail_valid)
        got = check_swiglu_bwd_gather(g_out, row_src, wdh, wds, cu, row_w, gate, up, pad=pad)
    # the all-padding group (2): g_y = 0 there, so d = 0: g_gate, g_up, g_row_w zero; h_w is not
    rows = slice(sum(lengths[:2]), sum(lengths[:3]))
    assert not got[0][rows].any() and not got[1][rows].any() and not got[3][rows].any()
    # every row padding, and no tokens at all (S = 0): d = 0 everywhere
    none = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    for tokens in (g_out, g_out[:0]):
        got = check_swiglu_bwd_gather(tokens, none, wdh, wds, cu, row_w, gate, up, pad=pad)
        assert not got[0].any() and not got[3].any()
    # N < S, one group, B = 0 (the slot map stands in for the empty slots)
    lengths = [0, 2 * pad, 0]
    _, wdh, wds, cu, row_w, gate, up = _make_swiglu_bwd(lengths, 3, hd=256, f=128, seed=pad + 3)
    check_swiglu_bwd_gather(g_out[:, :256].contiguous(), random_row_src(cu, 2 * pad, 301, 4), wdh, wds, cu,
                            row_w, gate, up, pad=pad)


@gpu
def test_swiglu_bwd_gather_design_shape():
    # H = 7168, F = 2048, ~40k rows from S = 8192 tokens, 8 home + 2 slot groups (an empty one of each, an
    # all-padding home group)
    epn, nb, pad = 8, 2, 128
    lengths = random_lengths(pad, epn, nb, 60, seed=39)
    n = sum(lengths) + 2 * pad
    _, wdh, wds, cu, row_w, gate, up = _make_swiglu_bwd(lengths, epn, hd=7168, f=2048, n_total=n, seed=39)
    assert n > 20_000, n
    g_out = random_tokens(8192, 7168, seed=40)
    check_swiglu_bwd_gather(g_out, random_row_src(cu, n, g_out.shape[0], 41, all_padding=(3,)), wdh, wds, cu,
                            row_w, gate, up)


@gpu
def test_swiglu_bwd_gather_cuda_graph_replay():
    from csrc_cute.group_gemm import group_gemm_swiglu_bwd_gather

    epn, nb, hd, f, n, s = 3, 2, 256, 384, 1536, 700
    _, wdh, wds, _, row_w, gate, up = _make_swiglu_bwd([0] * (epn + nb), epn, hd, f, n_total=n, seed=42)
    g_out = random_tokens(s, hd, seed=43)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device="cuda")
    row_src = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    cu.copy_(random_routing(epn, nb, n, 0))
    row_src.copy_(random_row_src(cu, n, s, 0))
    outs = [torch.empty_like(t) for t in check_swiglu_bwd_gather(g_out, row_src, wdh, wds, cu, row_w, gate, up)]

    def bwd_into_outs():
        for o, r in zip(outs, group_gemm_swiglu_bwd_gather(g_out, row_src, wdh, wds, cu, row_w, gate, up)):
            o.copy_(r)

    graph = capture_graph(bwd_into_outs)
    for seed in range(1, 4):
        cu.copy_(random_routing(epn, nb, n, seed))
        row_src.copy_(random_row_src(cu, n, s, seed, tail_valid=seed == 2))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        want = check_swiglu_bwd_gather(g_out, row_src, wdh, wds, cu, row_w, gate, up)
        assert all(torch.equal(o, w) for o, w in zip(outs, want)), seed


@gpu
@pytest.mark.parametrize("band_m", [0, 16])
def test_swiglu_pingpong_tiles_equal_the_cooperative_kernel(band_m):
    # the fused SwiGLU's pingpong option (GroupGemmConfig.pingpong, 128 x 96: no op chooses it yet,
    # bench_tiles measures it), plain and gathered, on 4 CTAs (each warp group takes many alternate tiles)
    # with empty home and slot groups, F = 600 (a partial last n tile of 24 columns), rows past the last
    # group: bitwise the cooperative 128 x 128 kernel, h, gate and up (the same k loop per element)
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    lengths = [384, 0, 128, 1152, 256, 0, 640, 128]  # epn = 5, B = 3
    n_total = sum(lengths) + 200
    x, wgh, wgs, wuh, wus, cu = random_swiglu_problem(lengths, 5, kd=320, nd=600, n_total=n_total, seed=63)
    tokens = random_tokens(1000, 320, seed=64)
    row_src = random_row_src(cu, n_total, tokens.shape[0], 65, all_padding=(2,))
    for op, a in (("swiglu", (x,)), ("swiglu_gather", (tokens, row_src))):
        outs = {}
        for config in (GroupGemmConfig(128, 128, 4), GroupGemmConfig(128, 96, 4, True, band_m)):
            bufs = [torch.full((n_total, 600), float("nan"), dtype=torch.bfloat16, device="cuda")
                    for _ in range(3)]
            compile_op(op, 320, 600, 128, 4, config)(*a, wgh, wgs, wuh, wus, cu, *bufs)
            torch.cuda.synchronize()
            outs[config.pingpong] = bufs
        for name, want, got in zip(("h", "gate", "up"), outs[False], outs[True]):
            assert torch.equal(want.nan_to_num(7.0), got.nan_to_num(7.0)), f"{op} {name} differs"
        assert not outs[True][0][:sum(lengths)].isnan().any(), f"{op}: rows of the groups unwritten"


@gpu
@pytest.mark.parametrize("band_m,tall_m_major", [(2, False), (64, False), (3, True)])
def test_banded_raster_swiglu_kernels_equal_the_m_major_raster(band_m, tall_m_major):
    # GroupGemmConfig.band_m (each group's tiles walked N-major in bands of band_m M tiles) of the fused
    # SwiGLU and the SwiGLU backward, on 4 CTAs with empty home and slot groups, groups of 1 to 9 M tiles,
    # partial last n tiles and rows past the last group: bitwise the M-major kernels, every output
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    lengths = [384, 0, 128, 1152, 256, 0, 640, 128]  # epn = 5, B = 3
    n_total = sum(lengths) + 200
    fwd = random_swiglu_problem(lengths, 5, kd=320, nd=600, n_total=n_total, seed=61)
    bwd = _make_swiglu_bwd(lengths, 5, hd=320, f=600, n_total=n_total, seed=62)
    for op, args, tile_n, n_out, widths in (("swiglu", fwd, 128, 3, (600,) * 3),
                                            ("swiglu_bwd_smem", bwd, 160, 4, (600,) * 3 + (-(-600 // 160),))):
        outs = {}
        for band in (0, band_m):
            bufs = [torch.full((n_total, w), float("nan"), dtype=torch.float32 if i == 3 else torch.bfloat16,
                               device="cuda") for i, w in enumerate(widths[:n_out])]
            config = GroupGemmConfig(128, tile_n, 4, op == "swiglu_bwd_smem", band, band > 0 and tall_m_major)
            compile_op(op, 320, 600, 128, 4, config)(*args, *bufs)
            torch.cuda.synchronize()
            outs[band] = bufs
        for i, (a, b) in enumerate(zip(outs[0], outs[band_m])):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{op} output {i} differs"
        assert not outs[0][0][:sum(lengths)].isnan().any(), f"{op}: rows of the groups unwritten"


@gpu
@pytest.mark.parametrize("band_m,f", [(0, 600), (4, 600), (16, 512)])
def test_weight_sharing_cluster_swiglu_kernels_equal_the_single_cta_kernels(band_m, f):
    # GroupGemmConfig.cluster_m = 2 of the fused SwiGLU, plain and gathered: clusters of two CTAs computing two M
    # tiles of one group at one n tile, each loading half of every gate and up tile into both by TMA multicast.
    # Groups of 3, 0, 1, 9, 2, 0, 5, 1 M tiles (lone last tiles: the cluster's CTAs compute two n tiles of it,
    # each loading its gate and up tiles whole; F = 600: 5 n tiles, the last 88 columns wide, so a lone tile's
    # last step puts the second CTA past F), the 200 rows past the last group, bands of 2 or 8 pairs with partial
    # bands at group ends; 4 CTAs (2 clusters, many pairs each): h, gate and up bitwise the kernels without
    # clusters
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    lengths = [384, 0, 128, 1152, 256, 0, 640, 128]  # epn = 5, B = 3
    n_total = sum(lengths) + 200
    x, wgh, wgs, wuh, wus, cu = random_swiglu_problem(lengths, 5, kd=320, nd=f, n_total=n_total, seed=69)
    tokens = random_tokens(1000, 320, seed=70)
    row_src = random_row_src(cu, n_total, tokens.shape[0], 71, all_padding=(2,))
    for op, a in (("swiglu", (x,)), ("swiglu_gather", (tokens, row_src))):
        outs = {}
        for cluster_m in (1, 2):
            bufs = [torch.full((n_total, f), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(3)]
            compile_op(op, 320, f, 128, 4, GroupGemmConfig(128, 128, 4, False, band_m, cluster_m=cluster_m))(
                *a, wgh, wgs, wuh, wus, cu, *bufs)
            torch.cuda.synchronize()
            outs[cluster_m] = bufs
        for name, want, got in zip(("h", "gate", "up"), outs[1], outs[2]):
            assert torch.equal(want.nan_to_num(7.0), got.nan_to_num(7.0)), f"{op} {name} differs"
        assert not outs[2][0][:sum(lengths)].isnan().any(), f"{op}: rows of the groups unwritten"


def _nan_swiglu_bwd_outputs(n, f, tile_n):
    """NaN-filled outputs of a SwiGLU-backward kernel of ``tile_n`` columns: g_gate, g_up, h_w [n, f] bf16 and the
    route-weight partial sums [n, ceil(f / tile_n)] fp32."""
    return [torch.full((n, w), float("nan"), dtype=torch.float32 if i == 3 else torch.bfloat16, device="cuda")
            for i, w in enumerate((f, f, f, -(-f // tile_n)))]


@gpu
@pytest.mark.parametrize("band_m,f", [(0, 600), (4, 600), (4, 440)])
def test_weight_sharing_cluster_swiglu_bwd_kernels_equal_the_single_cta_kernels(band_m, f):
    # GroupGemmConfig.cluster_m = 2 of the SwiGLU backward (both epilogues) and its gathered variant: clusters of
    # two CTAs computing two M tiles of one group at one n tile, each loading half of every W_down tile into both
    # by TMA multicast. Groups of 3, 0, 1, 9, 2, 0, 5, 1 M tiles (lone last tiles: the cluster's CTAs compute
    # two n tiles of it, each loading its W_down tile whole; F = 440: 3 n tiles, the last step's second CTA
    # reads zero rows of gate, up and g_y and stores nothing), the 200 rows past the last group, a partial last
    # n tile, bands of 2 pairs with partial bands at group ends; 4 CTAs (2 clusters, many pairs each): bitwise
    # the kernels without clusters, every output
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_group_gemm_swiglu_bwd, compile_op

    lengths = [384, 0, 128, 1152, 256, 0, 640, 128]  # epn = 5, B = 3
    n_total = sum(lengths) + 200
    g_y, *rest = _make_swiglu_bwd(lengths, 5, hd=320, f=f, n_total=n_total, seed=66)
    g_out = random_tokens(1000, 320, seed=67)
    row_src = random_row_src(rest[2], n_total, g_out.shape[0], 68, all_padding=(2,))
    kernels = (("registers", lambda cfg: compile_group_gemm_swiglu_bwd(320, f, cfg, "registers"), (g_y,)),
               ("smem", lambda cfg: compile_op("swiglu_bwd_smem", 320, f, 128, 4, cfg), (g_y,)),
               ("gather", lambda cfg: compile_op("swiglu_bwd_gather", 320, f, 128, 4, cfg), (g_out, row_src)))
    for name, compiled, a in kernels:
        outs = {}
        for cluster_m in (1, 2):
            bufs = _nan_swiglu_bwd_outputs(n_total, f, 160)
            compiled(GroupGemmConfig(128, 160, 4, True, band_m, cluster_m=cluster_m))(*a, *rest, *bufs)
            torch.cuda.synchronize()
            outs[cluster_m] = bufs
        for i, (want, got) in enumerate(zip(outs[1], outs[2])):
            assert torch.equal(want.nan_to_num(7.0), got.nan_to_num(7.0)), f"{name} output {i} differs"
        assert not outs[2][0][:sum(lengths)].isnan().any(), f"{name}: rows of the groups unwritten"


@gpu
@pytest.mark.parametrize("band_m,f", [(0, 600), (4, 600), (16, 520)])
@pytest.mark.parametrize("op", ["swiglu_bwd_smem", "swiglu_bwd_gather"])
def test_wide_swiglu_bwd_tile_equals_the_160_column_kernel(op, band_m, f):
    # the SwiGLU backward at 128 x 192 (its shared-memory epilogue's 64 x 32 sub-tiles computed in 16-column
    # halves; in clusters, the ops' tile where the HBM is slow: select_swiglu_bwd_config): groups of 3, 0, 1, 9,
    # 2, 0, 5, 1 M tiles, the 200 rows past the last group, F = 600 (a partial last n tile of 24 columns) or
    # 520 (3 n tiles of 192: the lone tiles' last step at one n tile); 4 CTAs. g_gate, g_up and h_w bitwise the
    # 128 x 160 kernel's (the same k loop per element); the route-weight gradient, whose per-tile partial sums
    # now cover 192 columns, within fp32 rounding of it; the 192-column tile in clusters sharing W_down
    # (cluster_m = 2) bitwise the unclustered one
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    lengths = [384, 0, 128, 1152, 256, 0, 640, 128]  # epn = 5, B = 3
    n_total, rows = sum(lengths) + 200, sum(lengths)
    g_y, *rest = _make_swiglu_bwd(lengths, 5, hd=320, f=f, n_total=n_total, seed=69)
    g_out = random_tokens(1000, 320, seed=70)
    a = (g_y,) if op == "swiglu_bwd_smem" else (g_out, random_row_src(rest[2], n_total, 1000, 71, all_padding=(2,)))
    outs = {}
    for tile_n, cluster_m in ((160, 1), (192, 1), (192, 2)):
        bufs = _nan_swiglu_bwd_outputs(n_total, f, tile_n)
        cfg = GroupGemmConfig(128, tile_n, 4, True, band_m, cluster_m=cluster_m)
        compile_op(op, 320, f, 128, 4, cfg)(*a, *rest, *bufs)
        torch.cuda.synchronize()
        outs[tile_n if cluster_m == 1 else "192 cluster"] = bufs
    for i, (want, got) in enumerate(zip(outs[192], outs["192 cluster"])):
        assert torch.equal(want.nan_to_num(7.0), got.nan_to_num(7.0)), f"clustered output {i} differs"
    for i, name in enumerate(("g_gate", "g_up", "h_w")):
        assert torch.equal(outs[160][i].nan_to_num(7.0), outs[192][i].nan_to_num(7.0)), f"{name} differs"
    assert not outs[192][0][:rows].isnan().any() and not outs[192][3][:rows].isnan().any()
    torch.testing.assert_close(outs[192][3][:rows].sum(1), outs[160][3][:rows].sum(1), rtol=1e-4, atol=1e-3)
