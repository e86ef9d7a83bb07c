"""GPU (Hopper) tests of the grouped GEMM weight gradient (csrc_cute/group_gemm/wgrad.py): home groups
written in bf16, slot groups accumulated in fp32, against a float reference; empty groups, partial tiles,
many work items per CTA; CUDA-graph replay of dgrad + wgrad; the registered ops; autograd of
``moonep::group_gemm`` on CUDA through the forward, dgrad and wgrad kernels; group_gemm_wgrad_gather (the
rows gathered from x by index) and group_gemm_wgrad_gather_b (dy's rows gathered from g_out by index, the
down projection's wgrad) bitwise against group_gemm_wgrad on the gathered rows. Skipped without a Hopper
GPU.
"""

import pytest
import torch

import moonep_ops  # noqa: F401  (registers moonep::group_gemm*, the reference ops)
from csrc_cute.group_gemm import group_gemm_dgrad, group_gemm_wgrad, group_gemm_wgrad_gather, group_gemm_wgrad_gather_b
from group_gemm_cases import (
    WGRAD_HOME_TOL,
    WGRAD_TOL,
    capture_graph,
    gathered_rows,
    gpu,
    nan_home_grads,
    random_bwd_problem,
    random_lengths,
    random_routing,
    random_row_src,
    random_tokens,
    reference_dgrad,
    unmultiplied_rows,
)


def reference_wgrad(x, dy, cu, dws, epn, pad=128):
    """Float reference of the wgrad op (the CPU op on fp32 copies of the bf16 inputs): returns the fp32
    home gradients [epn, Kd, Nd] (x_g^T dy_g, zeros for empty groups: what the kernel rounds to bf16
    once) and dws (fp32 slot gradients) with the slot groups' products added, on x's device."""
    h = torch.full((epn, x.shape[1], dy.shape[1]), float("nan"))
    s = dws.cpu().clone()
    torch.ops.moonep.group_gemm_wgrad(x.cpu().float(), dy.cpu().float(), cu.cpu(), h, s, pad)
    return h.to(x.device), s.to(x.device)


def _check_wgrad(dwh, dws, ref_h, ref_s):
    torch.cuda.synchronize()
    assert not dwh.isnan().any(), "every tile of dw_home must be written"
    torch.testing.assert_close(dwh.float(), ref_h, **WGRAD_HOME_TOL)
    torch.testing.assert_close(dws, ref_s, **WGRAD_TOL)


def _wgrad_case(x, dy, cu, epn, pad=128, seed=0):
    """wgrad onto NaN home gradients and random fp32 slot gradients, against the float reference: home
    groups written (an empty one: zeros), slot groups accumulated, empty slot groups untouched."""
    g = torch.Generator().manual_seed(seed)
    kd, nd, G = x.shape[1], dy.shape[1], cu.shape[0]
    dws0 = torch.randn(G - epn, kd, nd, generator=g).to(x.device)
    dwh, dws = nan_home_grads(epn, kd, nd), dws0.clone()
    group_gemm_wgrad(x, dy, cu, dwh, dws, pad=pad)
    ref_h, ref_s = reference_wgrad(x, dy, cu, dws0, epn, pad)
    _check_wgrad(dwh, dws, ref_h, ref_s)
    lengths = torch.diff(cu.cpu().long(), prepend=torch.zeros(1, dtype=torch.long))
    for grp in range(G):
        if grp < epn:
            if lengths[grp] == 0:
                assert not dwh[grp].any(), f"empty home group {grp}: dW must be written as zeros"
        elif lengths[grp] == 0:
            assert torch.equal(dws0[grp - epn], dws[grp - epn]), f"empty slot group {grp}: dW must be untouched"
        else:
            assert not torch.equal(dws0[grp - epn], dws[grp - epn]), f"slot group {grp} with rows: dW not updated"
    return dws0, dwh, dws


@gpu
@pytest.mark.parametrize("pad", [128, 64, 256])
def test_wgrad_random_groups_partial_tiles(pad):
    # Kd = 520 (tile_M 128: partial), Nd = 200 (tile_N 128: partial); padding rows past the end
    lengths = random_lengths(pad, 5, 4, 6, seed=pad + 3)
    x, dy, wh, ws, cu = random_bwd_problem(lengths, 5, kd=520, nd=200, n_total=sum(lengths) + 3 * pad, seed=pad)
    _wgrad_case(x, dy, cu, epn=5, pad=pad, seed=pad)


@gpu
def test_wgrad_many_work_items_big_k():
    # 16 groups x 4 x 4 tiles > #SMs: CTAs walk several items; groups up to 2048 rows (32 k tiles)
    lengths = random_lengths(128, 8, 8, 17, seed=5)
    x, dy, wh, ws, cu = random_bwd_problem(lengths, 8, kd=512, nd=1024, n_total=sum(lengths) + 256, seed=5)
    _wgrad_case(x, dy, cu, epn=8, seed=5)


@gpu
def test_wgrad_pingpong_tiles_equal_the_cooperative_kernel():
    # the pingpong 128 x 192 option (GroupGemmConfig.pingpong, measured by bench_tiles; no op chooses it):
    # Nd = 1000 (a partial last n tile), home and slot items, an empty slot group (skipped, its turn
    # passed on); 4 CTAs, so each warp group takes many alternate items. Bitwise the cooperative kernel
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    lengths = random_lengths(128, 5, 3, 7, seed=8)
    x, dy, wh, ws, cu = random_bwd_problem(lengths, 5, kd=384, nd=1000, n_total=sum(lengths) + 128, seed=8)
    dws0, dwh, dws = _wgrad_case(x, dy, cu, epn=5, seed=8)
    got_h, got_s = torch.full_like(dwh, float("nan")), dws0.clone()
    compile_op("wgrad", 384, 1000, 128, 4, GroupGemmConfig(128, 192, 4, pingpong=True))(x, dy, cu, got_h, got_s)
    torch.cuda.synchronize()
    assert torch.equal(got_h, dwh) and torch.equal(got_s, dws)


@gpu
@pytest.mark.parametrize("pingpong", [False, True])
def test_wgrad_cluster_tiles_equal_the_single_cta_kernel(pingpong):
    # GroupGemmConfig.cluster_n = 2: the two CTAs of a cluster compute one (group, m tile) at two
    # neighbouring n tiles, sharing its A (x^T) tiles by TMA multicast. Nd = 1200: 5 n tiles of 256 or 7 of
    # 192 (the last pair's second tile past dW, a partial tile before it); home and slot items, an empty
    # slot group; 4 CTAs (2 clusters, many items each). Bitwise the kernel without clusters
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    lengths = random_lengths(128, 5, 3, 7, seed=9)
    x, dy, wh, ws, cu = random_bwd_problem(lengths, 5, kd=384, nd=1200, n_total=sum(lengths) + 128, seed=9)
    dws0, dwh, dws = _wgrad_case(x, dy, cu, epn=5, seed=9)
    tile_n = 192 if pingpong else 256
    got = {}
    for cluster_n in (1, 2):
        got_h, got_s = torch.full_like(dwh, float("nan")), dws0.clone()
        compile_op("wgrad", 384, 1200, 128, 4, GroupGemmConfig(128, tile_n, 4, pingpong, cluster_n=cluster_n))(
            x, dy, cu, got_h, got_s)
        got[cluster_n] = (got_h, got_s)
    torch.cuda.synchronize()
    assert torch.equal(got[2][0], got[1][0]) and torch.equal(got[2][1], got[1][1])
    assert torch.equal(got[2][0], dwh) and torch.equal(got[2][1], dws)


@gpu
def test_wgrad_all_rows_one_group_and_b0():
    # all rows in one home group (the other home groups: zeros), all in the slot group (every home
    # group: zeros), and B = 0
    for lengths, epn in (([0, 0, 2048, 0], 3), ([0, 0, 0, 2048], 3), ([0, 640, 128], 3)):
        x, dy, wh, ws, cu = random_bwd_problem(lengths, epn, kd=256, nd=384, n_total=sum(lengths) + 128, seed=7)
        _wgrad_case(x, dy, cu, epn=epn, seed=7)


@gpu
def test_wgrad_all_home_groups_empty_writes_zeros():
    # no rows at all in any group (the padding rows past the end are ignored): every home tile is zeros
    x, dy, wh, ws, cu = random_bwd_problem([0, 0, 0, 0], 2, kd=520, nd=200, n_total=256, seed=8)
    _, dwh, _ = _wgrad_case(x, dy, cu, epn=2, seed=8)
    assert not dwh.any()


@gpu
def test_wgrad_home_overwritten_slots_accumulate_over_calls():
    lengths = [256, 0, 384, 128]
    x, dy, wh, ws, cu = random_bwd_problem(lengths, 2, kd=256, nd=256, seed=3)
    dws0, dwh, dws = _wgrad_case(x, dy, cu, epn=2, seed=3)
    first_h = dwh.clone()
    group_gemm_wgrad(x, dy, cu, dwh, dws)  # the home gradients are written again, the slots add again
    _, once_s = reference_wgrad(x, dy, cu, dws0, 2)
    ref_h, ref_s = reference_wgrad(x, dy, cu, once_s, 2)
    _check_wgrad(dwh, dws, ref_h, ref_s)
    assert torch.equal(dwh, first_h), "the home gradients must be overwritten (bitwise the same values)"
    assert not dwh[1].any()


@gpu
def test_dgrad_and_wgrad_cuda_graph_replay_matches_eager():
    epn, nb, kd, nd, n = 4, 2, 384, 512, 2048
    x, dy, wh, ws, _ = random_bwd_problem([0] * (epn + nb), epn, kd, nd, n_total=n)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device="cuda")
    cu.copy_(random_routing(epn, nb, n, 0))
    dx = torch.empty(n, kd, dtype=torch.bfloat16, device="cuda")
    dwh = torch.zeros(epn, kd, nd, dtype=torch.bfloat16, device="cuda")
    dws = torch.zeros(nb, kd, nd, device="cuda")
    group_gemm_dgrad(dy, wh, ws, cu, out=dx)  # compile + warm up outside capture
    group_gemm_wgrad(x, dy, cu, dwh, dws)
    graph = capture_graph(lambda: (group_gemm_dgrad(dy, wh, ws, cu, out=dx), group_gemm_wgrad(x, dy, cu, dwh, dws)))
    gen = torch.Generator().manual_seed(1)
    for seed in range(1, 5):  # new routings land on the device only; the graph is replayed as is
        cu.copy_(random_routing(epn, nb, n, seed))
        init_s = torch.randn(nb, kd, nd, generator=gen).cuda()
        dwh.fill_(float("nan"))
        dws.copy_(init_s)
        dx.fill_(float("nan"))
        graph.replay()
        eager_dx = group_gemm_dgrad(dy, wh, ws, cu)
        eager_h, eager_s = nan_home_grads(epn, kd, nd), init_s.clone()
        group_gemm_wgrad(x, dy, cu, eager_h, eager_s)
        torch.cuda.synchronize()
        assert torch.equal(dx, eager_dx), f"dgrad: graph replay differs from eager (seed {seed})"
        assert torch.equal(dwh, eager_h) and torch.equal(dws, eager_s), f"wgrad: replay != eager (seed {seed})"
        torch.testing.assert_close(dx.float(), reference_dgrad(dy, wh, ws, cu).float(), atol=2e-2, rtol=2e-2)
        _check_wgrad(dwh, dws, *reference_wgrad(x, dy, cu, init_s, epn))


@gpu
def test_registered_dgrad_and_wgrad_ops_dispatch_to_the_kernels():
    """The CPU-only custom ops have CUDA kernels: torch.ops.moonep.* on CUDA tensors run ours (bitwise)."""
    lengths = [128, 0, 256, 128]
    x, dy, wh, ws, cu = random_bwd_problem(lengths, 2, kd=256, nd=192, seed=9)
    dx = torch.ops.moonep.group_gemm_dgrad(dy, wh, ws, cu, 128)
    assert dx.is_cuda and torch.equal(dx, group_gemm_dgrad(dy, wh, ws, cu, pad=128))
    torch.testing.assert_close(dx.float(), reference_dgrad(dy, wh, ws, cu).float(), atol=2e-2, rtol=2e-2)
    dwh = nan_home_grads(2, 256, 192)
    dws = torch.ones(2, 256, 192, device="cuda")
    h2, s2 = dwh.clone(), dws.clone()
    assert torch.ops.moonep.group_gemm_wgrad(x, dy, cu, dwh, dws, 128) is None
    group_gemm_wgrad(x, dy, cu, h2, s2, pad=128)
    assert torch.equal(dwh, h2) and torch.equal(dws, s2)
    _check_wgrad(dwh, dws, *reference_wgrad(x, dy, cu, torch.ones_like(dws), 2))
    assert not dwh[1].any()  # the empty home group


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_autograd_group_gemm_on_cuda(pad):
    """group_gemm forward + backward on CUDA (our fwd, dgrad and wgrad kernels) vs CPU reference autograd."""
    lengths = random_lengths(pad, 3, 2, 5, seed=21 + pad)
    x, dy, wh, ws, cu = random_bwd_problem(lengths, 3, kd=320, nd=264, n_total=sum(lengths) + pad, seed=21)
    grads = []
    for dev in ("cuda", "cpu"):
        leaves = [t.detach().to(dev).requires_grad_(True) for t in (x, wh, ws)]
        y = torch.ops.moonep.group_gemm(leaves[0], leaves[1], leaves[2], cu.to(dev), pad)
        (y.float() * dy.to(dev).float()).sum().backward()
        grads.append([t.grad for t in leaves])
    for name, got, ref in zip(("x", "w_home", "w_slot"), *grads):
        assert got.is_cuda and got.dtype == torch.bfloat16, name
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(got.float().cpu(), ref.float(), atol=2e-2 * max(scale, 1.0), rtol=2e-2,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")
    # rows past the last group get zero gradient; empty groups' weights get zero gradient
    end = int(cu[-1])
    assert torch.count_nonzero(grads[0][0][end:]) == 0
    assert torch.count_nonzero(grads[0][1][1]) == 0 and torch.count_nonzero(grads[0][2][1]) == 0


# ------------------------------------------------------------------------------------------------
# wgrad with the rows gathered from x by index (group_gemm_wgrad_gather)
# ------------------------------------------------------------------------------------------------


def check_wgrad_gather(x, row_src, dy, cu, epn, pad=128, seed=0):
    """``group_gemm_wgrad_gather`` bitwise against ``group_gemm_wgrad`` on the gathered rows of x
    (``check_gathered_wgrad``)."""
    return check_gathered_wgrad(lambda h, s: group_gemm_wgrad_gather(x, row_src, dy, cu, h, s, pad=pad),
                                gathered_rows(x, row_src), dy, cu, epn, pad, seed)


def check_wgrad_gather_b(x, dy_src, row_src, cu, epn, pad=128, seed=0):
    """``group_gemm_wgrad_gather_b`` bitwise against ``group_gemm_wgrad`` on the gathered rows of dy_src
    (``check_gathered_wgrad``)."""
    return check_gathered_wgrad(lambda h, s: group_gemm_wgrad_gather_b(x, dy_src, row_src, cu, h, s, pad=pad),
                                x, gathered_rows(dy_src, row_src), cu, epn, pad, seed)


def check_gathered_wgrad(run_gathered, x, dy, cu, epn, pad, seed):
    """A gathered kernel (``run_gathered(dw_home, dw_slot)``) bitwise against ``group_gemm_wgrad`` on the
    materialised operands ``x``, ``dy``, both onto NaN home gradients (every element must be written) and
    the same random fp32 slot gradients (the slot groups' accumulation). Returns (initial slots, home
    gradients, slots)."""
    g = torch.Generator().manual_seed(seed)
    kd, nd, groups = x.shape[1], dy.shape[1], cu.shape[0]
    dws0 = torch.randn(groups - epn, kd, nd, generator=g).to(dy.device)
    got_h, got_s = nan_home_grads(epn, kd, nd), dws0.clone()
    run_gathered(got_h, got_s)
    want_h, want_s = nan_home_grads(epn, kd, nd), dws0.clone()
    group_gemm_wgrad(x, dy, cu, want_h, want_s, pad=pad)
    torch.cuda.synchronize()
    assert not got_h.isnan().any(), "every tile of dw_home must be written"
    assert torch.equal(got_h, want_h), f"dw_home differs in {(got_h != want_h).sum().item()} elements"
    assert torch.equal(got_s, want_s), f"dw_slot differs in {(got_s != want_s).sum().item()} elements"
    return dws0, got_h, got_s


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_wgrad_gather_equals_wgrad_on_gathered_rows(pad):
    # Kd = 520: partial last m tile (chunks past H zero-filled); Nd = 200: partial n tile; empty home and
    # slot groups, an all-padding group, slot groups with rows (fp32 accumulation), padding rows in every
    # group, rows past the last group (padding or valid tokens: neither kernel reads them), token S - 1,
    # a token in several groups and repeated within one
    epn = 5
    lengths = random_lengths(pad, epn, 4, 6, seed=70 + pad)
    lengths[2] = max(lengths[2], pad)
    _, dy, _, _, cu = random_bwd_problem(lengths, epn, kd=520, nd=200, n_total=sum(lengths) + 3 * pad, seed=pad)
    n = dy.shape[0]
    x = random_tokens(301, 520, seed=pad + 1)
    for seed, tail_valid in ((0, False), (1, True)):
        row_src = random_row_src(cu, n, x.shape[0], seed, all_padding=(2,), tail_valid=tail_valid)
        _, dwh, _ = check_wgrad_gather(x, row_src, dy, cu, epn, pad=pad, seed=seed)
    assert not dwh[1].any() and not dwh[2].any(), "empty and all-padding home groups: zeros"
    # every row padding: home gradients zeros, slot gradients + 0
    none = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    dws0, dwh, dws = check_wgrad_gather(x, none, dy, cu, epn, pad=pad, seed=2)
    assert not dwh.any() and torch.equal(dws, dws0)
    # tile_M = 64 (Kd <= 64: one consumer warp group, 4 k rows per producer thread), N < S, B = 0
    lengths = [0, pad, pad]
    _, dy, _, _, cu = random_bwd_problem(lengths, 3, kd=64, nd=128, seed=pad + 2)
    check_wgrad_gather(x[:, :64].contiguous(), random_row_src(cu, dy.shape[0], 301, 3), dy, cu, 3, pad=pad)
    # no tokens at all (S = 0): every row is padding, the home gradients zeros
    none = torch.full((dy.shape[0],), -1, dtype=torch.int32, device="cuda")
    _, dwh, _ = check_wgrad_gather(x[:0, :64], none, dy, cu, 3, pad=pad)
    assert not dwh.any()


@gpu
@pytest.mark.parametrize("op", ["wgrad_gather", "wgrad_gather_t"])
def test_gathered_wgrad_pingpong_tiles_equal_the_wgrad(op):
    # the gathered wgrads with pingpong 128 x 192 consumers (each warp group whole items, alternating; the
    # four producer warps gathering; wgrad_gather_t: the gathered-A wgrad of dW^T into the transposed
    # gradients, the down projection's): Nd = 1000 (a partial last n tile; wgrad_gather_t: a partial last m
    # tile), home and slot items, an empty slot group, padding rows; 4 CTAs, many items each. Bitwise the
    # wgrad on the gathered rows
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    epn = 5
    lengths = random_lengths(128, epn, 3, 7, seed=12)
    rows, dy, _, _, cu = random_bwd_problem(lengths, epn, kd=384, nd=1000, n_total=sum(lengths) + 128, seed=12)
    tokens = random_tokens(301, 384 if op == "wgrad_gather" else 1000, seed=13)
    row_src = random_row_src(cu, dy.shape[0], tokens.shape[0], 4)
    kd, nd = (1000, 384) if op == "wgrad_gather_t" else (384, 1000)
    kernel = compile_op(op, kd, nd, 128, 4, GroupGemmConfig(128, 192, 4, pingpong=True))
    if op == "wgrad_gather":  # A = the tokens' rows gathered, B = dy
        check_gathered_wgrad(lambda h, s: kernel(tokens, row_src, dy, cu, h, s), gathered_rows(tokens, row_src), dy,
                             cu, epn, 128, 12)
    else:  # dW^T: A = the tokens' rows gathered, B = rows by TMA, stored into the transposes of dW
        check_gathered_wgrad(lambda h, s: kernel(tokens, row_src, rows, cu, h.transpose(1, 2), s.transpose(1, 2)),
                             rows, gathered_rows(tokens, row_src), cu, epn, 128, 12)


@gpu
@pytest.mark.parametrize("op", ["wgrad_gather", "wgrad_gather_t"])
@pytest.mark.parametrize("pingpong", [False, True])
def test_gathered_wgrads_skip_the_padding_blocks_at_group_ends(op, pingpong):
    # the 16-row k blocks after a group's last routed row (among its last 128 rows) are not multiplied: NaN
    # in the other operand's rows there (dy; wgrad_gather_t: the rows by TMA) leaves the gradients finite and
    # bitwise the wgrad with those rows zero. Groups of up to 640 rows with 1 .. all of them routed, slot
    # groups, an all-padding group, an empty one; cooperative 128 x 128 and pingpong 128 x 192 consumers
    from csrc_cute.group_gemm.config import GroupGemmConfig
    from csrc_cute.group_gemm.host import compile_op

    epn = 5
    lengths = random_lengths(128, epn, 3, 6, seed=40)
    rows, dy, _, _, cu = random_bwd_problem(lengths, epn, kd=384, nd=520, n_total=sum(lengths) + 128, seed=41)
    tokens = random_tokens(301, 384 if op == "wgrad_gather" else 520, seed=42)
    row_src = random_row_src(cu, dy.shape[0], tokens.shape[0], 43, all_padding=(2,))
    skipped = unmultiplied_rows(cu, row_src)
    assert skipped.sum() > 128, "the case must have padding blocks to skip"
    config = GroupGemmConfig(128, 192, 4, pingpong=True) if pingpong else GroupGemmConfig(128, 128, 4)
    kd, nd = (520, 384) if op == "wgrad_gather_t" else (384, 520)
    kernel = compile_op(op, kd, nd, 128, 4, config)
    other = dy if op == "wgrad_gather" else rows
    nan_there = torch.where(skipped[:, None], float("nan"), other.float()).bfloat16()
    zero_there = torch.where(skipped[:, None], 0.0, other.float()).bfloat16()
    if op == "wgrad_gather":
        check_gathered_wgrad(lambda h, s: kernel(tokens, row_src, nan_there, cu, h, s),
                             gathered_rows(tokens, row_src), zero_there, cu, epn, 128, 44)
    else:
        check_gathered_wgrad(lambda h, s: kernel(tokens, row_src, nan_there, cu, h.transpose(1, 2),
                                                 s.transpose(1, 2)),
                             zero_there, gathered_rows(tokens, row_src), cu, epn, 128, 44)


@gpu
def test_wgrad_gather_design_shape():
    # the gate/up projection's wgrad: A = x^T [H = 7168, N], B = dy [N, F = 2048], P = 128; ~22k rows from
    # S = 8192 tokens, 8 home + 2 slot groups (an empty one of each, an all-padding home group)
    epn, nb, pad = 8, 2, 128
    lengths = random_lengths(pad, epn, nb, 60, seed=19)
    _, dy, _, _, cu = random_bwd_problem(lengths, epn, kd=64, nd=2048, n_total=sum(lengths) + 2 * pad, seed=19)
    assert dy.shape[0] > 20_000, dy.shape
    x = random_tokens(8192, 7168, seed=20)
    check_wgrad_gather(x, random_row_src(cu, dy.shape[0], x.shape[0], 21, all_padding=(3,)), dy, cu, epn, seed=22)


def replay_gathered_wgrad(run_gathered, plain_operands, cu, row_src, epn, kd, nd, s):
    """Capture ``run_gathered(dw_home, dw_slot)`` (a gathered wgrad reading ``cu`` and ``row_src`` on the
    device) once, then replay it with new routings and token indices (of ``s`` tokens): bitwise
    ``group_gemm_wgrad(*plain_operands(), ...)`` on the rows gathered then, onto NaN home gradients and
    random slot gradients each time."""
    nb, n = cu.shape[0] - epn, row_src.shape[0]
    dwh = torch.zeros(epn, kd, nd, dtype=torch.bfloat16, device="cuda")
    dws = torch.zeros(nb, kd, nd, device="cuda")
    cu.copy_(random_routing(epn, nb, n, 0))
    row_src.copy_(random_row_src(cu, n, s, 0))
    run_gathered(dwh, dws)  # compiled before the capture
    graph = capture_graph(lambda: run_gathered(dwh, dws))
    for seed in range(1, 4):
        cu.copy_(random_routing(epn, nb, n, seed))
        row_src.copy_(random_row_src(cu, n, s, seed, tail_valid=seed == 2))
        init_s = torch.randn(nb, kd, nd, generator=torch.Generator().manual_seed(seed)).cuda()
        dwh.fill_(float("nan"))
        dws.copy_(init_s)
        graph.replay()
        want_h, want_s = nan_home_grads(epn, kd, nd), init_s.clone()
        group_gemm_wgrad(*plain_operands(), cu, want_h, want_s)
        torch.cuda.synchronize()
        assert torch.equal(dwh, want_h) and torch.equal(dws, want_s), f"replay != wgrad on gathered rows ({seed})"


@gpu
def test_wgrad_gather_cuda_graph_replay():
    epn, nb, kd, nd, n, s = 4, 2, 384, 256, 2048, 700
    _, dy, _, _, _ = random_bwd_problem([0] * (epn + nb), epn, kd, nd, n_total=n, seed=23)
    x = random_tokens(s, kd, seed=24)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device="cuda")
    row_src = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    replay_gathered_wgrad(lambda h, w: group_gemm_wgrad_gather(x, row_src, dy, cu, h, w),
                          lambda: (gathered_rows(x, row_src), dy), cu, row_src, epn, kd, nd, s)


# ------------------------------------------------------------------------------------------------
# wgrad with dy's rows gathered from g_out by index (group_gemm_wgrad_gather_b: the down projection)
# ------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("pad", [128, 64])
def test_wgrad_gather_b_equals_wgrad_on_gathered_rows(pad):
    # Nd = 520: partial last n tile (chunks past H zero-filled); Kd = 200: partial m tile; empty home and
    # slot groups, an all-padding group, slot groups with rows (fp32 accumulation), padding rows in every
    # group, rows past the last group (padding or valid tokens: neither kernel reads them), token S - 1,
    # a token in several groups and repeated within one
    epn = 5
    lengths = random_lengths(pad, epn, 4, 6, seed=80 + pad)
    lengths[2] = max(lengths[2], pad)
    x, _, _, _, cu = random_bwd_problem(lengths, epn, kd=200, nd=64, n_total=sum(lengths) + 3 * pad, seed=pad)
    n = x.shape[0]
    g_out = random_tokens(301, 520, seed=pad + 5)
    for seed, tail_valid in ((0, False), (1, True)):
        row_src = random_row_src(cu, n, g_out.shape[0], seed, all_padding=(2,), tail_valid=tail_valid)
        _, dwh, _ = check_wgrad_gather_b(x, g_out, row_src, cu, epn, pad=pad, seed=seed)
    assert not dwh[1].any() and not dwh[2].any(), "empty and all-padding home groups: zeros"
    # every row padding: home gradients zeros, slot gradients + 0
    none = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    dws0, dwh, dws = check_wgrad_gather_b(x, g_out, none, cu, epn, pad=pad, seed=2)
    assert not dwh.any() and torch.equal(dws, dws0)
    # tile_M = 64, tile_N = 128 (Kd <= 64, Nd = 128: 8 k rows per producer thread), N < S, B = 0
    lengths = [0, pad, pad]
    x, _, _, _, cu = random_bwd_problem(lengths, 3, kd=64, nd=64, seed=pad + 2)
    g_out = g_out[:, :128].contiguous()
    check_wgrad_gather_b(x, g_out, random_row_src(cu, x.shape[0], 301, 3), cu, 3, pad=pad)
    # no tokens at all (S = 0): every row is padding, the home gradients zeros
    none = torch.full((x.shape[0],), -1, dtype=torch.int32, device="cuda")
    _, dwh, _ = check_wgrad_gather_b(x, g_out[:0], none, cu, 3, pad=pad)
    assert not dwh.any()


@gpu
def test_wgrad_gather_b_design_shape():
    # the down projection's wgrad: A = h_w^T [F = 2048, N], B = g_y [N, H = 7168] gathered from g_out
    # [S = 8192, H], P = 128; ~22k rows, 8 home + 2 slot groups (an empty one of each, an all-padding home group)
    epn, nb, pad = 8, 2, 128
    lengths = random_lengths(pad, epn, nb, 60, seed=29)
    x, _, _, _, cu = random_bwd_problem(lengths, epn, kd=2048, nd=64, n_total=sum(lengths) + 2 * pad, seed=29)
    assert x.shape[0] > 20_000, x.shape
    g_out = random_tokens(8192, 7168, seed=30)
    check_wgrad_gather_b(x, g_out, random_row_src(cu, x.shape[0], g_out.shape[0], 31, all_padding=(3,)), cu, epn,
                         seed=32)


@gpu
def test_wgrad_gather_b_cuda_graph_replay():
    epn, nb, kd, nd, n, s = 4, 2, 256, 384, 2048, 700
    x, _, _, _, _ = random_bwd_problem([0] * (epn + nb), epn, kd, 64, n_total=n, seed=33)
    g_out = random_tokens(s, nd, seed=34)
    cu = torch.zeros(epn + nb, dtype=torch.int32, device="cuda")
    row_src = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    replay_gathered_wgrad(lambda h, w: group_gemm_wgrad_gather_b(x, g_out, row_src, cu, h, w),
                          lambda: (x, gathered_rows(g_out, row_src)), cu, row_src, epn, kd, nd, s)


@gpu
@pytest.mark.parametrize("op", ["wgrad", "wgrad_gather", "wgrad_gather_t"])
@pytest.mark.parametrize("pingpong", [False, True])
def test_weight_sharing_cluster_wgrads_equal_the_wgrad(op, pingpong):
    # GroupGemmConfig.cluster_m = 2: the two CTAs of a cluster compute two m tiles of one (group, n tile),
    # each loading half of every B tile (dy^T; wgrad_gather_t: the rows by TMA) into both by TMA multicast.
    # M = 520: 5 m tiles (a partial one, then the last pair's second tile past dW: zero A, the gathered
    # chunks predicated off, the stores dropped); Nd = 1000 (a partial last n tile); home and slot items,
    # padding rows; 4 CTAs (2 clusters, many items each). Bitwise the wgrad on the (gathered) rows
    from csrc_cute.group_gemm.config import GroupGemmConfig

    _check_wgrad_variant(op, GroupGemmConfig(128, 192 if pingpong else 256, 4, pingpong, cluster_m=2))


def _check_wgrad_variant(op, config):
    """``op``'s kernel compiled with ``config`` at M = 520, Nd = 1000 over 5 home and 3 slot groups on 4 CTAs:
    bitwise the wgrad of the (gathered) rows (``check_gathered_wgrad``)."""
    from csrc_cute.group_gemm.host import compile_op

    epn, m, n_cols = 5, 520, 1000
    lengths = random_lengths(128, epn, 3, 7, seed=15)
    x, dy, _, _, cu = random_bwd_problem(lengths, epn, kd=m, nd=n_cols, n_total=sum(lengths) + 128, seed=15)
    kernel = compile_op(op, m, n_cols, 128, 4, config)
    tokens = random_tokens(301, m, seed=16)
    row_src = random_row_src(cu, dy.shape[0], tokens.shape[0], 17)
    if op == "wgrad":
        check_gathered_wgrad(lambda h, s: kernel(x, dy, cu, h, s), x, dy, cu, epn, 128, 15)
    elif op == "wgrad_gather":  # A = the tokens' rows gathered, B = dy
        check_gathered_wgrad(lambda h, s: kernel(tokens, row_src, dy, cu, h, s), gathered_rows(tokens, row_src), dy,
                             cu, epn, 128, 15)
    else:  # dW^T: A = the tokens' rows gathered, B = dy's rows by TMA, stored into the transposes of dW
        check_gathered_wgrad(lambda h, s: kernel(tokens, row_src, dy, cu, h.transpose(1, 2), s.transpose(1, 2)),
                             dy, gathered_rows(tokens, row_src), cu, epn, 128, 15)
