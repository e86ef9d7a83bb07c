"""The tile walks (csrc_cute/group_gemm/walk.py). The dynamic walk (``GroupGemmConfig.dynamic``): the persistent
CTAs take their tiles in order from one global counter instead of every #CTAs-th tile. The scheduler warp
(``GroupGemmConfig.scheduler_warp``, the default): producer warp 1 computes the static walk's tile coordinates and
hands them on through a shared ring. Each output element keeps its k loop, so every kernel family is bitwise its
static-walk kernel of the same tile without the scheduler warp: checked on the GPU on 4 CTAs (many tiles each) with
empty home and slot groups, partial tiles and rows past the last group, in clusters sharing B too (lone tiles of
odd groups), launched twice (the dynamic counter is zeroed for every launch) and replayed in a CUDA graph. CPU:
the config's rules and the compile checks (test_group_gemm_compile.py)."""

import pytest
import torch

from csrc_cute.group_gemm.config import GroupGemmConfig
from group_gemm_cases import (
    gpu,
    random_bwd_problem,
    random_lengths,
    random_problem,
    random_row_src,
    random_row_weights,
    random_swiglu_problem,
    random_tokens,
)

LENGTHS = [384, 0, 128, 1152, 256, 0, 640, 128]  # epn = 5, B = 3: empty home and slot groups
EPN = 5


def test_dynamic_walk_config_rules():
    assert GroupGemmConfig(128, 192, 132, True, 16, dynamic=True).dynamic
    assert not GroupGemmConfig(128, 192, 132, True, 16).dynamic
    with pytest.raises(ValueError, match="dynamic needs cluster_n = 1"):
        GroupGemmConfig(128, 256, 132, cluster_n=2, dynamic=True)


def test_remote_kernels_refuse_the_dynamic_walk():
    # the remote variants build their donor descriptors at the CTA's first remote tile of its static walk
    from csrc_cute.group_gemm.rows import GroupGemmRowScaleRemoteSm90

    with pytest.raises(ValueError, match="dynamic must be False"):
        GroupGemmRowScaleRemoteSm90(GroupGemmConfig(128, 256, 132, dynamic=True))


def walks_agree(op, kd, nd, static, args, outs, other=None):
    """Launch ``op``'s kernel of tile config ``static`` and of ``other`` (default: the same config with the
    dynamic walk) on ``args`` into fresh copies of ``outs`` (NaN-filled, or what an accumulating output holds),
    the other one twice; assert every output is bitwise equal, and return the first kernel's."""
    from csrc_cute.group_gemm.host import compile_op

    other = GroupGemmConfig(*static[:7], True) if other is None else other
    got = []
    for config, launches in ((static, 1), (other, 2)):
        for _ in range(launches):
            bufs = [o.clone() for o in outs]
            compile_op(op, kd, nd, 128, 4, config)(*args, *bufs)
            got.append(bufs)
    torch.cuda.synchronize()
    want = got[0]
    for run in got[1:]:
        for i, (a, b) in enumerate(zip(want, run)):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{op} output {i}: {other} differs"
    return want


def nan_rows(n, cols, dtype=torch.bfloat16):
    return torch.full((n, cols), float("nan"), dtype=dtype, device="cuda")


@gpu
@pytest.mark.parametrize("pingpong,band_m", [(False, 0), (True, 16), (True, 0)])
def test_dynamic_walk_row_kernels_equal_the_static_walk(pingpong, band_m):
    # forward, row-scaled forward and dgrad2 (cooperative 128 x 256 or pingpong 128 x 192, M-major or banded)
    tile_n = 192 if pingpong else 256
    static = GroupGemmConfig(128, tile_n, 4, pingpong, band_m)
    n_total = sum(LENGTHS) + 200
    x, wh, ws, cu = random_problem(LENGTHS, EPN, kd=320, nd=1216, n_total=n_total, seed=81)
    y = walks_agree("fwd", 320, 1216, static, (x, wh, ws, cu), [nan_rows(n_total, 1216)])[0]
    assert not y[:sum(LENGTHS)].isnan().any(), "rows of the groups unwritten"
    row_w = random_row_weights(n_total, seed=82)
    walks_agree("row_scale", 320, 1216, static, (x, wh, ws, cu, row_w), [nan_rows(n_total, 1216)])
    _, dy_a, wa_h, wa_s, _ = random_bwd_problem(LENGTHS, EPN, 1216, 320, n_total=n_total, seed=83)
    _, dy_b, wb_h, wb_s, _ = random_bwd_problem(LENGTHS, EPN, 1216, 320, n_total=n_total, seed=84)
    walks_agree("dgrad2", 1216, 320, static, (dy_a, wa_h, wa_s, dy_b, wb_h, wb_s, cu), [nan_rows(n_total, 1216)])


def swiglu_bwd_operands(n_total, seed):
    """The SwiGLU backward's operands besides its A (F = 600, H = 320): home and slot W_down, the forward's gate
    and up, the rows' route weights."""
    gen = torch.Generator().manual_seed(seed)
    wdh = (torch.randn(EPN, 600, 320, generator=gen) / 600**0.5).bfloat16().cuda()
    wds = (torch.randn(len(LENGTHS) - EPN, 600, 320, generator=gen) / 600**0.5).bfloat16().cuda()
    gate = (torch.randn(n_total, 600, generator=gen) * 2).bfloat16().cuda()
    up = torch.randn(n_total, 600, generator=gen).bfloat16().cuda()
    row_w = torch.rand(n_total, generator=gen).cuda()
    return wdh, wds, gate, up, row_w


@gpu
def test_dynamic_walk_gathered_swiglu_kernels_equal_the_static_walk():
    # the layer's gathered SwiGLU (cooperative, four producer warps walking the tiles: warp 0 writes the walk,
    # the others read it) and its backward (pingpong, shared-memory epilogue), banded, F = 600 (partial n tiles)
    n_total = sum(LENGTHS) + 200
    _, wgh, wgs, wuh, wus, cu = random_swiglu_problem(LENGTHS, EPN, kd=320, nd=600, n_total=n_total, seed=85)
    tokens = random_tokens(1000, 320, seed=86)
    row_src = random_row_src(cu, n_total, tokens.shape[0], 87, all_padding=(2,))
    h = walks_agree("swiglu_gather", 320, 600, GroupGemmConfig(128, 128, 4, False, 16),
                    (tokens, row_src, wgh, wgs, wuh, wus, cu), [nan_rows(n_total, 600) for _ in range(3)])[0]
    assert not h[:sum(LENGTHS)].isnan().any(), "rows of the groups unwritten"
    wdh, wds, gate, up, row_w = swiglu_bwd_operands(n_total, seed=88)
    g_out = random_tokens(1000, 320, seed=89)
    outs = [nan_rows(n_total, 600) for _ in range(3)] + [nan_rows(n_total, -(-600 // 160), torch.float32)]
    walks_agree("swiglu_bwd_gather", 320, 600, GroupGemmConfig(128, 160, 4, False, 16),
                (g_out, row_src, wdh, wds, cu, row_w, gate, up), outs)


@gpu
@pytest.mark.parametrize("op,pingpong", [("wgrad", False), ("wgrad_gather", True), ("wgrad_gather_t", True)])
def test_dynamic_walk_wgrads_equal_the_static_walk(op, pingpong):
    # work items (group, m tile, n tile) from the counter; home items stored, slot items added into the fp32
    # buffers (each launch starts from the same buffer), an empty slot group, padding rows
    lengths = random_lengths(128, EPN, 3, 7, seed=90)
    rows, dy, _, _, cu = random_bwd_problem(lengths, EPN, kd=384, nd=1000, n_total=sum(lengths) + 128, seed=91)
    kd, nd = (1000, 384) if op == "wgrad_gather_t" else (384, 1000)
    tokens = random_tokens(301, 384 if op == "wgrad_gather" else 1000, seed=92)
    row_src = random_row_src(cu, dy.shape[0], tokens.shape[0], 93)
    args = {"wgrad": (rows, dy, cu), "wgrad_gather": (tokens, row_src, dy, cu),
            "wgrad_gather_t": (tokens, row_src, rows, cu)}[op]
    nb = len(lengths) - EPN
    dwh = torch.full((EPN, nd, kd) if op == "wgrad_gather_t" else (EPN, kd, nd), float("nan"),
                     dtype=torch.bfloat16, device="cuda")
    dws = torch.randn((nb, nd, kd) if op == "wgrad_gather_t" else (nb, kd, nd),
                      generator=torch.Generator().manual_seed(94)).cuda()
    if op == "wgrad_gather_t":  # into the transposes of the gradients
        dwh, dws = dwh.transpose(1, 2), dws.transpose(1, 2)
    tile_n = 192 if pingpong else 128
    walks_agree(op, kd, nd, GroupGemmConfig(128, tile_n, 4, pingpong), args, [dwh, dws])


@gpu
def test_dynamic_walk_cuda_graph_replay():
    # the counter is zeroed inside the captured launch: every replay walks all the tiles again
    from csrc_cute.group_gemm.host import compile_op

    n_total = sum(LENGTHS) + 200
    x, wh, ws, cu = random_problem(LENGTHS, EPN, kd=320, nd=1216, n_total=n_total, seed=95)
    kernel = compile_op("fwd", 320, 1216, 128, 4, GroupGemmConfig(128, 192, 4, True, 16, dynamic=True))
    want = nan_rows(n_total, 1216)
    compile_op("fwd", 320, 1216, 128, 4, GroupGemmConfig(128, 192, 4, True, 16))(x, wh, ws, cu, want)
    y = nan_rows(n_total, 1216)
    kernel(x, wh, ws, cu, y)  # warm (the counter's allocation) before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(x, wh, ws, cu, y)
    for _ in range(3):
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y.nan_to_num(7.0), want.nan_to_num(7.0))


def unscheduled(config: GroupGemmConfig) -> GroupGemmConfig:
    return GroupGemmConfig(*config[:9], scheduler_warp=False)


def test_which_kernels_walk_the_ring():
    """With the scheduler warp, every kernel whose producer is one warp has the ring (the loading warp and the
    consumers, pingpong ones included, read the tiles' coordinates from it; the row-scaled pingpong kernel in
    clusters sharing B too, since the walk ends with ``WALK_END`` rather than #tiles); without it none has."""
    from csrc_cute.group_gemm.rows import GroupGemmRowScaleSm90, GroupGemmSm90
    from csrc_cute.group_gemm.swiglu_bwd import GroupGemmSwigluBwdSm90
    from csrc_cute.group_gemm.wgrad import GroupGemmWgradSm90

    clustered = GroupGemmConfig(128, 192, 132, True, 16, cluster_m=2)  # the H100's dgrad and SwiGLU backward
    unclustered = GroupGemmConfig(128, 192, 132, True, 16)  # the H200's dgrad and row-scaled forward
    cooperative = GroupGemmConfig(128, 256, 132, False, 64, cluster_m=2)
    for config in (clustered, unclustered, cooperative):
        kernels = (GroupGemmSm90(config, b_k_major=True), GroupGemmRowScaleSm90(config),
                   GroupGemmSwigluBwdSm90(config), GroupGemmWgradSm90(config))
        assert [(k.scheduled, k.walked) for k in kernels] == [(True, True)] * 4
        assert not GroupGemmSm90(unscheduled(config), b_k_major=True).walked


@gpu
@pytest.mark.parametrize("pingpong,band_m,cluster_m", [(False, 64, 1), (True, 16, 2), (False, 16, 2), (True, 0, 1)])
def test_scheduler_warp_row_kernels_equal_the_unscheduled_walk(pingpong, band_m, cluster_m):
    # forward, row-scaled forward, dgrad2: the consumers, cooperative and pingpong, read the scheduler's ring; in
    # clusters sharing B (pairs of M tiles of a group, odd groups' lone tiles)
    tile_n = 192 if pingpong else 256
    config = GroupGemmConfig(128, tile_n, 4, pingpong, band_m, cluster_m=cluster_m)
    assert config.scheduler_warp
    n_total = sum(LENGTHS) + 200
    x, wh, ws, cu = random_problem(LENGTHS, EPN, kd=320, nd=1216, n_total=n_total, seed=101)
    y = walks_agree("fwd", 320, 1216, unscheduled(config), (x, wh, ws, cu), [nan_rows(n_total, 1216)], config)[0]
    assert not y[:sum(LENGTHS)].isnan().any(), "rows of the groups unwritten"
    row_w = random_row_weights(n_total, seed=102)
    walks_agree("row_scale", 320, 1216, unscheduled(config), (x, wh, ws, cu, row_w), [nan_rows(n_total, 1216)],
                config)
    _, dy_a, wa_h, wa_s, _ = random_bwd_problem(LENGTHS, EPN, 1216, 320, n_total=n_total, seed=103)
    _, dy_b, wb_h, wb_s, _ = random_bwd_problem(LENGTHS, EPN, 1216, 320, n_total=n_total, seed=104)
    walks_agree("dgrad2", 1216, 320, unscheduled(config), (dy_a, wa_h, wa_s, dy_b, wb_h, wb_s, cu),
                [nan_rows(n_total, 1216)], config)


@gpu
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_scheduler_warp_swiglu_kernels_equal_the_unscheduled_walk(cluster_m):
    # the fused SwiGLU (cooperative: its consumers read the ring) and its backward (pingpong, shared-memory
    # epilogue; in clusters sharing W_down), banded, F = 600 (partial n tiles)
    n_total = sum(LENGTHS) + 200
    x, wgh, wgs, wuh, wus, cu = random_swiglu_problem(LENGTHS, EPN, kd=320, nd=600, n_total=n_total, seed=105)
    config = GroupGemmConfig(128, 128, 4, False, 16)
    h = walks_agree("swiglu", 320, 600, unscheduled(config), (x, wgh, wgs, wuh, wus, cu),
                    [nan_rows(n_total, 600) for _ in range(3)], config)[0]
    assert not h[:sum(LENGTHS)].isnan().any(), "rows of the groups unwritten"
    wdh, wds, gate, up, row_w = swiglu_bwd_operands(n_total, seed=106)
    g_y = random_tokens(n_total, 320, seed=107)
    outs = [nan_rows(n_total, 600) for _ in range(3)] + [nan_rows(n_total, -(-600 // 192), torch.float32)]
    config = GroupGemmConfig(128, 192, 4, False, 16, cluster_m=cluster_m)
    walks_agree("swiglu_bwd_smem", 320, 600, unscheduled(config), (g_y, wdh, wds, cu, row_w, gate, up), outs,
                config)


@gpu
@pytest.mark.parametrize("pingpong,cluster_m", [(False, 1), (True, 2)])
def test_scheduler_warp_wgrad_equals_the_unscheduled_walk(pingpong, cluster_m):
    # work items of the scheduler's ring: home items stored, slot items added into the fp32 buffers (each launch
    # starts from the same buffer), an empty slot group, padding rows; in clusters sharing dy^T
    lengths = random_lengths(128, EPN, 3, 7, seed=108)
    rows, dy, _, _, cu = random_bwd_problem(lengths, EPN, kd=384, nd=1000, n_total=sum(lengths) + 128, seed=109)
    nb = len(lengths) - EPN
    dwh = torch.full((EPN, 384, 1000), float("nan"), dtype=torch.bfloat16, device="cuda")
    dws = torch.randn((nb, 384, 1000), generator=torch.Generator().manual_seed(110)).cuda()
    config = GroupGemmConfig(128, 192 if pingpong else 128, 4, pingpong, cluster_m=cluster_m)
    walks_agree("wgrad", 384, 1000, unscheduled(config), (rows, dy, cu), [dwh, dws], config)
