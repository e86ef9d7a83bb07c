"""GPU (Hopper) tests of the row-wise grouped GEMM kernels (csrc_cute/group_gemm/rows.py): forward, dgrad,
dgrad2 (two operand pairs into one accumulator) and the row-scaled forward, against the CPU reference ops;
empty groups, slot groups, partial tiles, rows past the last group; CUDA-graph capture and replay; the
registered ops dispatch to the kernels. Skipped without a Hopper GPU.
"""

import pytest
import torch

import moonep_ops  # noqa: F401  (registers moonep::group_gemm*, the reference ops)
from csrc_cute.group_gemm import group_gemm_dgrad, group_gemm_dgrad2, group_gemm_fwd
from group_gemm_cases import (
    capture_graph,
    check_row_scale,
    check_rows,
    gpu,
    random_bwd_problem,
    random_lengths,
    random_problem,
    random_row_weights,
    reference_dgrad,
    reference_group_gemm,
)


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------


def _check_fwd(x, wh, ws, cu, pad=128):
    out = torch.full((x.shape[0], wh.shape[2]), float("nan"), dtype=torch.bfloat16, device=x.device)
    return check_rows(group_gemm_fwd(x, wh, ws, cu, pad=pad, out=out), reference_group_gemm(x, wh, ws, cu, pad), cu)


@gpu
@pytest.mark.parametrize("pad", [128, 64, 256])
def test_random_groups_with_empty_and_slots(pad):
    gen = torch.Generator().manual_seed(pad)
    epn, nb = 5, 4
    lengths = (torch.randint(0, 6, (epn + nb,), generator=gen) * pad).tolist()
    lengths[1] = 0  # an empty home group
    lengths[epn + 1] = 0  # an empty slot group
    lengths[epn] = max(lengths[epn], pad)  # a slot group with rows
    tail = 3 * pad  # padding rows past the last group
    x, wh, ws, cu = random_problem(lengths, epn, kd=520, nd=384, n_total=sum(lengths) + tail, seed=pad)
    _check_fwd(x, wh, ws, cu, pad=pad)


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_many_tiles_per_cta(pad):
    # More tiles than SMs: each persistent CTA walks several tiles, mixing real, empty and zero tiles.
    gen = torch.Generator().manual_seed(7 + pad)
    epn, nb = 8, 8
    lengths = (torch.randint(0, 13, (epn + nb,), generator=gen) * pad).tolist()
    lengths[3] = 0
    lengths[epn + 2] = 0
    x, wh, ws, cu = random_problem(lengths, epn, kd=256, nd=1024, n_total=sum(lengths) + 5 * pad, seed=pad)
    _check_fwd(x, wh, ws, cu, pad=pad)


@gpu
def test_all_rows_one_group():
    lengths = [0, 0, 1024, 0]
    x, wh, ws, cu = random_problem(lengths, epn=3, kd=256, nd=512)
    _check_fwd(x, wh, ws, cu)
    # ... and all rows in the single slot group
    lengths = [0, 0, 0, 1024]
    x, wh, ws, cu = random_problem(lengths, epn=3, kd=256, nd=512, seed=1)
    _check_fwd(x, wh, ws, cu)


@gpu
def test_groups_of_exactly_p_rows():
    lengths = [128] * 12
    x, wh, ws, cu = random_problem(lengths, epn=6, kd=1024, nd=256)
    _check_fwd(x, wh, ws, cu)


@gpu
def test_no_slots_b0_and_many_groups():
    lengths = [128 * ((i * 7) % 5) for i in range(40)]
    x, wh, ws, cu = random_problem(lengths, epn=40, kd=128, nd=136, n_total=sum(lengths) + 256)
    assert ws.shape[0] == 0
    _check_fwd(x, wh, ws, cu)


@gpu
def test_slot_weights_are_read_from_w_slot():
    # Home and slot weights differ by sign: a mix-up would flip the result.
    lengths = [256, 256]
    x, wh, ws, cu = random_problem(lengths, epn=1, kd=128, nd=128)
    ws.copy_(-wh)
    y = _check_fwd(x, wh, ws, cu)
    torch.testing.assert_close(
        y[256:].float(), -(x[256:].float() @ wh[0].float()).bfloat16().float(), atol=2e-2, rtol=2e-2
    )


@gpu
def test_all_padding_zero_rows():
    x, wh, ws, cu = random_problem([0, 0, 0], epn=2, kd=64, nd=64, n_total=512)
    y = _check_fwd(x, wh, ws, cu)
    assert torch.count_nonzero(y) == 0


@gpu
def test_cuda_graph_replay_matches_eager():
    epn, nb, kd, nd, n = 4, 2, 512, 512, 2048
    x, wh, ws, _ = random_problem([0] * (epn + nb), epn, kd, nd, n_total=n)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device="cuda")

    def routing(seed):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, 4, (epn + nb,), generator=gen) * 128
        return lengths.cumsum(0).clamp(max=n).to(torch.int32)

    cu.copy_(routing(0))
    group_gemm_fwd(x, wh, ws, cu)  # compile + warm up outside capture
    out = torch.empty(n, nd, dtype=torch.bfloat16, device="cuda")
    graph = capture_graph(lambda: group_gemm_fwd(x, wh, ws, cu, out=out), warm=True)
    for seed in range(1, 5):  # new routings land on the device only; the graph is replayed as is
        cu.copy_(routing(seed))
        out.fill_(float("nan"))
        graph.replay()
        eager = group_gemm_fwd(x, wh, ws, cu)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"graph replay differs from eager (seed {seed})"
        torch.testing.assert_close(
            out.float(), reference_group_gemm(x, wh, ws, cu).float(), atol=2e-2, rtol=2e-2
        )


@gpu
def test_registered_cuda_op_and_autograd_boundary():
    """torch.ops.moonep.group_gemm on CUDA tensors runs this kernel."""
    x, wh, ws, cu = random_problem([128, 0, 256, 128], 2, 256, 192)
    y = torch.ops.moonep.group_gemm(x, wh, ws, cu, 128)
    torch.testing.assert_close(y.float(), reference_group_gemm(x, wh, ws, cu).float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------
# dgrad
# ------------------------------------------------------------------------------------------------


def _check_dgrad(dy, wh, ws, cu, pad=128):
    out = torch.full((dy.shape[0], wh.shape[1]), float("nan"), dtype=torch.bfloat16, device=dy.device)
    return check_rows(group_gemm_dgrad(dy, wh, ws, cu, pad=pad, out=out), reference_dgrad(dy, wh, ws, cu, pad), cu)


@gpu
@pytest.mark.parametrize("pad", [128, 64, 256])
def test_dgrad_random_groups_partial_tiles(pad):
    # Kd = 520: partial output tile; Nd = 200: partial k tile (TMA zero fill)
    lengths = random_lengths(pad, 5, 4, 6, seed=pad)
    x, dy, wh, ws, cu = random_bwd_problem(lengths, 5, kd=520, nd=200, n_total=sum(lengths) + 3 * pad, seed=pad)
    _check_dgrad(dy, wh, ws, cu, pad=pad)


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_dgrad_many_tiles_per_cta(pad):
    lengths = random_lengths(pad, 8, 8, 13, seed=11 + pad)
    x, dy, wh, ws, cu = random_bwd_problem(lengths, 8, kd=1024, nd=256, n_total=sum(lengths) + 5 * pad, seed=pad)
    _check_dgrad(dy, wh, ws, cu, pad=pad)


@gpu
def test_dgrad_all_rows_one_group_and_b0():
    for lengths, epn in (([0, 0, 1024, 0], 3), ([0, 0, 0, 1024], 3), ([256, 0, 512], 3)):
        x, dy, wh, ws, cu = random_bwd_problem(lengths, epn, kd=384, nd=512, n_total=sum(lengths) + 128)
        _check_dgrad(dy, wh, ws, cu)
    assert ws.shape[0] == 0


@gpu
def test_dgrad_slot_weights_are_read_from_w_slot():
    x, dy, wh, ws, cu = random_bwd_problem([256, 256], 1, kd=128, nd=128)
    ws.copy_(-wh)
    dx = _check_dgrad(dy, wh, ws, cu)
    torch.testing.assert_close(dx[256:].float(), -(dy[256:].float() @ wh[0].float().t()).bfloat16().float(),
                               atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------
# dgrad2: two operand pairs into one accumulator
# ------------------------------------------------------------------------------------------------


def _make_dgrad2(lengths, epn, kd, nd, n_total=None, seed=0):
    """Two random dgrad operand pairs over the same groups: ((dy_a, wa_home, wa_slot), (dy_b, wb_home,
    wb_slot), cu_seqlens) on the GPU."""
    _, dy_a, wa_h, wa_s, cu = random_bwd_problem(lengths, epn, kd, nd, n_total=n_total, seed=seed)
    _, dy_b, wb_h, wb_s, _ = random_bwd_problem(lengths, epn, kd, nd, n_total=n_total, seed=seed + 7)
    return (dy_a, wa_h, wa_s), (dy_b, wb_h, wb_s), cu


def reference_dgrad2_fp32(pair_a, pair_b, cu):
    """fp32 reference of dgrad2, never rounded: per group dy_a @ Wa^T + dy_b @ Wb^T in fp32 on the GPU (TF32
    off), zeros past the last group. The kernel rounds its fp32 sum once, so it has no bitwise twin."""
    dy_a, wa_h, wa_s = pair_a
    dy_b, wb_h, wb_s = pair_b
    epn = wa_h.shape[0]
    ref = torch.zeros(dy_a.shape[0], wa_h.shape[1], dtype=torch.float32, device=dy_a.device)
    ends = cu.tolist()
    for g, (s0, e0) in enumerate(zip([0] + ends[:-1], ends)):
        if e0 > s0:
            wa, wb = (wa_h[g], wb_h[g]) if g < epn else (wa_s[g - epn], wb_s[g - epn])
            ref[s0:e0] = dy_a[s0:e0].float() @ wa.float().t() + dy_b[s0:e0].float() @ wb.float().t()
    return ref


def _check_dgrad2(pair_a, pair_b, cu, pad=128):
    """dgrad2 into a NaN-poisoned output: every row written (groups: the sum within bf16 tolerance of the
    fp32 reference, one rounding; past the last group: zeros); returns the output."""
    dy_a = pair_a[0]
    out = torch.full((dy_a.shape[0], pair_a[1].shape[1]), float("nan"), dtype=torch.bfloat16, device=dy_a.device)
    dx = group_gemm_dgrad2(*pair_a, *pair_b, cu, pad=pad, out=out)
    torch.cuda.synchronize()
    assert dx.data_ptr() == out.data_ptr()
    assert not dx.isnan().any(), "every row of the output must be written"
    end = int(cu[-1])
    assert not dx[end:].any(), "rows past the last group must be zero"
    ref = reference_dgrad2_fp32(pair_a, pair_b, cu)
    torch.testing.assert_close(dx.float(), ref, atol=1e-2, rtol=1e-2)
    # one rounding of the fp32 sum: at most half a bf16 ulp (2^-9 relative) plus fp32 summation-order noise
    err = (dx.float() - ref).abs()
    assert bool((err <= ref.abs() * 2.0**-8 + 1e-3).all()), float((err - ref.abs() * 2.0**-8).max())
    return dx


def _check_dgrad2_pairs_separately(pair_a, pair_b, cu, pad=128):
    """With the other pair's rows zero, dgrad2 is the plain dgrad of one pair bit for bit (the same k loop
    and wgmma order, plus exact zeros): each pair's A and B loads reach the accumulator, with the home /
    slot weights of the right pair."""
    zeros = torch.zeros_like(pair_a[0])
    only_a = group_gemm_dgrad2(*pair_a, zeros, *pair_b[1:], cu, pad=pad)
    only_b = group_gemm_dgrad2(zeros, *pair_a[1:], *pair_b, cu, pad=pad)
    assert torch.equal(only_a, group_gemm_dgrad(*pair_a, cu, pad=pad))
    assert torch.equal(only_b, group_gemm_dgrad(*pair_b, cu, pad=pad))


@gpu
@pytest.mark.parametrize("pad", [128, 64, 256])
def test_dgrad2_random_groups_partial_tiles(pad):
    # Kd = 520: partial output tile; Nd = 200: each pair's last k tile partial (TMA zero fill)
    lengths = random_lengths(pad, 5, 4, 6, seed=pad + 5)
    pair_a, pair_b, cu = _make_dgrad2(lengths, 5, kd=520, nd=200, n_total=sum(lengths) + 3 * pad, seed=pad)
    _check_dgrad2(pair_a, pair_b, cu, pad=pad)
    _check_dgrad2_pairs_separately(pair_a, pair_b, cu, pad=pad)


@gpu
def test_dgrad2_tiles_are_bitwise_equal():
    # the dgrad2's tiles: pingpong 128 x 192 in bands of 16 M tiles (its tile on an H200), cooperative 128 x 256
    # in bands of 64 (on an H100: select_hbm_rows_config) and M-major (select_config's). Kd = 1216 = 6 x 192 + 64 =
    # 4 x 256 + 192: a partial last n tile in each; 4 CTAs, so each warp group takes many tiles; rows past the
    # last group. Bitwise equal to each other: the same k loop per output element, only the tiling differs
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    lengths = random_lengths(128, 6, 3, 9, seed=41)
    pair_a, pair_b, cu = _make_dgrad2(lengths, 6, kd=1216, nd=320, n_total=sum(lengths) + 200, seed=41)
    want = _check_dgrad2(pair_a, pair_b, cu)
    for config in (GroupGemmConfig(128, 192, 4, True, 16), GroupGemmConfig(128, 256, 4, False, 64),
                   GroupGemmConfig(128, 256, 4)):
        got = torch.full_like(want, float("nan"))
        compile_op("dgrad2", 1216, 320, 128, 4, config)(*pair_a, *pair_b, cu, got)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"{tuple(config)}: differs in {(got != want).any(1).sum().item()} rows"


@gpu
def test_dgrad2_one_group_b0_and_slot_weights():
    for lengths, epn in (([0, 0, 1024, 0], 3), ([0, 0, 0, 1024], 3), ([256, 0, 512], 3)):
        pair_a, pair_b, cu = _make_dgrad2(lengths, epn, kd=384, nd=512, n_total=sum(lengths) + 128)
        _check_dgrad2(pair_a, pair_b, cu)
    assert pair_a[2].shape[0] == 0  # B = 0
    # the slot group reads each pair's slot weights: slots equal to the home weights, then negated
    # (negating every product of a group negates its fp32 sum and its rounding exactly)
    pair_a, pair_b, cu = _make_dgrad2([256, 256], 1, kd=128, nd=128)
    pair_a[2].copy_(pair_a[1])
    pair_b[2].copy_(pair_b[1])
    dx_same = _check_dgrad2(pair_a, pair_b, cu).clone()
    pair_a[2].neg_()
    pair_b[2].neg_()
    dx_neg = _check_dgrad2(pair_a, pair_b, cu)
    assert torch.equal(dx_neg[:256], dx_same[:256])
    assert torch.equal(dx_neg[256:], -dx_same[256:])


@gpu
def test_dgrad2_realistic_shape_48_groups():
    # the gate/up projections' input gradient at H = 7168, F = 2048: 48 groups (32 home experts, 16 slots),
    # some empty, padding rows past the end; many tiles per CTA
    pad = 128
    lengths = random_lengths(pad, 32, 16, 5, seed=48)
    pair_a, pair_b, cu = _make_dgrad2(lengths, 32, kd=7168, nd=2048, n_total=sum(lengths) + 2 * pad, seed=48)
    _check_dgrad2(pair_a, pair_b, cu, pad=pad)
    _check_dgrad2_pairs_separately(pair_a, pair_b, cu, pad=pad)


@gpu
def test_registered_dgrad2_op_dispatches_to_the_kernel_and_captures():
    pad = 128
    pair_a, pair_b, cu = _make_dgrad2(random_lengths(pad, 3, 2, 4, seed=9), 3, kd=256, nd=384, seed=9)
    eager = group_gemm_dgrad2(*pair_a, *pair_b, cu, pad=pad)
    assert torch.equal(torch.ops.moonep.group_gemm_dgrad2(*pair_a, *pair_b, cu, pad), eager)
    # within bf16 tolerance of the CPU reference op (fp32 sum, one rounding)
    cpu = torch.ops.moonep.group_gemm_dgrad2(*(t.cpu() for t in pair_a), *(t.cpu() for t in pair_b), cu.cpu(), pad)
    torch.testing.assert_close(eager.cpu().float(), cpu.float(), atol=2e-2, rtol=2e-2)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        group_gemm_dgrad2(*pair_a, *pair_b, cu, pad=pad, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# ------------------------------------------------------------------------------------------------
# the row-scaled forward (route weights)
# ------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_row_scale_random_groups(pad):
    lengths = random_lengths(pad, 5, 4, 6, seed=60 + pad)
    x, wh, ws, cu = random_problem(lengths, 5, kd=520, nd=200, n_total=sum(lengths) + 3 * pad + 64, seed=pad)  # partial M
    row_w = random_row_weights(x.shape[0], seed=pad)
    y = check_row_scale(x, wh, ws, cu, row_w, pad)
    assert torch.count_nonzero(y[:7]) == 0
    # one rounding: equal to the plain forward's fp32 result scaled, not to bf16(x W) * w
    plain = group_gemm_fwd(x, wh, ws, cu, pad=pad).float() * row_w[:, None]
    torch.testing.assert_close(y.float(), plain, atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("pingpong,band_m,tall_m_major", [(False, 2, False), (True, 3, False), (False, 64, False),
                                                         (False, 3, True)])
def test_banded_raster_tiles_equal_the_m_major_raster(pingpong, band_m, tall_m_major):
    # GroupGemmConfig.band_m walks each group's tiles N-major in bands of band_m M tiles: on 4 CTAs (many
    # tiles each, pingpong warp groups alternating), with empty home and slot groups, groups of 1 to 9 M
    # tiles (bands cut short by the group's end; band_m = 64: one band per group), a partial last n tile
    # and rows past the last group, the forward and dgrad2 are bitwise the M-major kernels (each output
    # element has the same k loop); tall_m_major with bands of 3: the groups of 1-3 M tiles banded, the
    # groups of 5 and 9 M-major
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    lengths = [384, 0, 128, 1152, 256, 0, 640, 128]  # epn = 5, B = 3
    config = GroupGemmConfig(128, 192 if pingpong else 256, 4, pingpong, band_m, tall_m_major)
    x, wh, ws, cu = random_problem(lengths, 5, kd=320, nd=1216, n_total=sum(lengths) + 200, seed=53)
    want = _check_fwd(x, wh, ws, cu)
    got = torch.full_like(want, float("nan"))
    compile_op("fwd", 320, 1216, 128, 4, config)(x, wh, ws, cu, got)
    torch.cuda.synchronize()
    assert torch.equal(got, want), f"forward differs in {(got != want).any(1).sum().item()} rows"
    pair_a, pair_b, cu = _make_dgrad2(lengths, 5, kd=1216, nd=320, n_total=sum(lengths) + 200, seed=54)
    want = _check_dgrad2(pair_a, pair_b, cu)
    got = torch.full_like(want, float("nan"))
    compile_op("dgrad2", 1216, 320, 128, 4, config)(*pair_a, *pair_b, cu, got)
    torch.cuda.synchronize()
    assert torch.equal(got, want), f"dgrad2 differs in {(got != want).any(1).sum().item()} rows"


@gpu
@pytest.mark.parametrize("pingpong,band_m,tall_m_major", [(False, 0, False), (True, 0, False), (False, 2, False),
                                                         (False, 3, True)])
def test_cluster_tiles_equal_the_single_cta_kernels(pingpong, band_m, tall_m_major):
    # GroupGemmConfig.cluster_n = 2: clusters of two CTAs computing one M tile at two neighbouring n tiles,
    # each loading half of every A tile into both by TMA multicast. With an odd number of n tiles (1216
    # columns: 5 tiles of 256 or 7 of 192, the last pair's second tile past the output, a partial tile
    # before it)
    from csrc_cute.group_gemm.config import GroupGemmConfig

    tile_n = 192 if pingpong else 256
    _check_variant_kernels_equal(GroupGemmConfig(128, tile_n, 4, pingpong, band_m, tall_m_major),
                                 GroupGemmConfig(128, tile_n, 4, pingpong, band_m, tall_m_major, cluster_n=2))


@gpu
@pytest.mark.parametrize("pingpong,band_m,cols", [(False, 0, 1216), (True, 0, 1216), (True, 2, 1216), (False, 4, 1216),
                                                  (True, 4, 1152)])
def test_weight_sharing_cluster_tiles_equal_the_single_cta_kernels(pingpong, band_m, cols):
    # GroupGemmConfig.cluster_m = 2: clusters of two CTAs computing two M tiles of one group at one n tile, each
    # loading half of every B tile into both by TMA multicast. The groups (3, 0, 1, 9, 2, 0, 5, 1 M tiles: 21)
    # have lone last tiles (tiles 2, 3, 12, 19, 20: the cluster's CTAs take two n tiles of it, each loading its
    # weight tile whole; with an odd number of n tiles, 1216 columns in 7 tiles of 192 or 5 of 256, the last
    # one's second CTA loads zeros for A and stores nothing; 1152 columns: 6 tiles of 192, none), empty groups
    # and even ones; the 200 rows past the last group make M tiles 21 and 22 (one pair, no loads, zeros); the
    # walk counts (23 + 8 + 1) / 2 = 16 pairs of n tiles; each group's pairs in bands of 1 and 2 pairs (band_m
    # 2, 4), partial bands at group ends, the lone tile in its group's last band
    from csrc_cute.group_gemm.config import GroupGemmConfig

    tile_n = 192 if pingpong else 256
    _check_variant_kernels_equal(GroupGemmConfig(128, tile_n, 4, pingpong, band_m),
                                 GroupGemmConfig(128, tile_n, 4, pingpong, band_m, cluster_m=2), cols=cols)


def _check_variant_kernels_equal(single, variant, cols: int = 1216):
    """On 4 CTAs (2 clusters, many tiles each), with empty home and slot groups, groups of 1 to 9 M tiles and
    rows past the last group, the forward, row-scaled forward, dgrad and dgrad2 compiled with ``variant`` (another
    raster, clusters) are bitwise the kernels compiled with ``single`` (each output element has the same k loop),
    which match the reference; ``cols``: the outputs' columns."""
    from csrc_cute.group_gemm.host import compile_op

    lengths = [384, 0, 128, 1152, 256, 0, 640, 128]  # epn = 5, B = 3

    def both(op, kd, nd, args, out):
        got = {}
        for name, cfg in (("single", single), ("variant", variant)):
            got[name] = torch.full_like(out, float("nan"))
            compile_op(op, kd, nd, 128, 4, cfg)(*args, got[name])
        torch.cuda.synchronize()
        diff = (got["variant"] != got["single"]).any(1).sum().item()
        assert torch.equal(got["variant"], got["single"]), f"{op}: the {variant} kernel differs in {diff} rows"
        return got["variant"]

    x, wh, ws, cu = random_problem(lengths, 5, kd=320, nd=cols, n_total=sum(lengths) + 200, seed=71)
    check_rows(both("fwd", 320, cols, (x, wh, ws, cu), torch.empty(x.shape[0], cols, dtype=torch.bfloat16,
                                                                    device=x.device)),
               reference_group_gemm(x, wh, ws, cu), cu)
    row_w = random_row_weights(x.shape[0], seed=71)
    y = both("row_scale", 320, cols, (x, wh, ws, cu, row_w), torch.empty(x.shape[0], cols, dtype=torch.bfloat16,
                                                                          device=x.device))
    torch.testing.assert_close(y, check_row_scale(x, wh, ws, cu, row_w), atol=0, rtol=0)
    _, dy, wh, ws, cu = random_bwd_problem(lengths, 5, kd=cols, nd=320, n_total=sum(lengths) + 200, seed=72)
    check_rows(both("dgrad", cols, 320, (dy, wh, ws, cu), torch.empty(dy.shape[0], cols, dtype=torch.bfloat16,
                                                                       device=dy.device)),
               reference_dgrad(dy, wh, ws, cu, 128), cu)
    pair_a, pair_b, cu = _make_dgrad2(lengths, 5, kd=cols, nd=320, n_total=sum(lengths) + 200, seed=73)
    want = _check_dgrad2(pair_a, pair_b, cu)
    got = both("dgrad2", cols, 320, (*pair_a, *pair_b, cu), torch.empty_like(want))
    if not single.pingpong and not single.band_m:  # the op's own kernel (banded only past 8 n tiles)
        assert torch.equal(got, want)
