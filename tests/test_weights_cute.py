"""Weight-path kernels (csrc_cute/weights.py): prefetch of expert copies and the copy-gradient reduce.

CPU (CI): the kernels compile for sm_90a with no spills; host validation. GPU (one device, R ranks
simulated with one buffer set per rank and peer tables of their addresses): exact copies, the reduce
bitwise equal to bf16(float(home) + the fp32 copies in rank order) on bf16 home gradients (experts
without copies untouched), zeroing of used slots only, CUDA-graph replay; experts_to_copy entries outside
[-1, E) skipped and flagged (STATUS_BAD_TABLE) with every written buffer canary-guarded.
"""


import pytest
import torch

from canaries import Canaries
from kernel_compile import check_module_compiles
from moonep_ops import planning

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def test_weight_kernels_compile_sm90a():
    configs = [[2, 48, 48, 7168, 2048], [8, 4, 8, 64, 40]]
    check_module_compiles("csrc_cute.weights:compile_all_for_check",
                          ("_prefetch_kernel", "_reduce_pull_kernel", "_reduce_zero_kernel"), len(configs),
                          kwargs={"configs": configs})


def test_host_validation():
    from csrc_cute import weights

    w = torch.zeros(2, 8, 8, dtype=torch.bfloat16)
    etc = torch.zeros(2, 2, dtype=torch.int32)
    peers = torch.zeros(2, dtype=torch.int64)
    st = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="experts_to_copy.*CUDA|CUDA.*experts_to_copy|experts_to_copy"):
        weights.prefetch_push(w, w, w, etc, peers, peers, peers, 0, st)
    if HAS_CUDA:
        dev = "cuda"
        wc, ec, pc, sc = w.to(dev), etc.to(dev), peers.to(dev), st.to(dev)
        with pytest.raises(ValueError, match="w_down must have shape"):
            weights.prefetch_push(wc, wc, wc[:, :4].contiguous(), ec, pc, pc, pc, 0, sc)
        with pytest.raises(ValueError, match="rank must be in"):
            weights.prefetch_push(wc, wc, wc, ec, pc, pc, pc, 2, sc)
        with pytest.raises(ValueError, match="peer_pool_up"):
            weights.prefetch_push(wc, wc, wc, ec, pc, pc[:1], pc, 0, sc)
        with pytest.raises(ValueError, match="status must hold exactly 1 int32 element"):
            weights.prefetch_push(wc, wc, wc, ec, pc, pc, pc, 0, torch.zeros(2, dtype=torch.int32, device=dev))
        # reduce_pull: the home gradients are bf16 (the copies' fp32 reduce buffers are read by address)
        hf = torch.zeros(2, 8, 16, device=dev)
        hd = torch.zeros(2, 16, 8, device=dev)
        with pytest.raises(ValueError, match="home_gate must have dtype"):
            weights.reduce_pull(ec, pc, pc, pc, hf, hf, hd, 0, sc)
        hb, hdb = hf.bfloat16(), hd.bfloat16()
        with pytest.raises(ValueError, match="home_down must have shape"):
            weights.reduce_pull(ec, pc, pc, pc, hb, hb, hb, 0, sc)
        with pytest.raises(ValueError, match="H\\*F must be a multiple of 128"):
            weights.reduce_pull(ec, pc, pc, pc, hb[:, :, :8].contiguous(), hb[:, :, :8].contiguous(),
                                hdb[:, :8].contiguous(), 0, sc)


def _plan_slots(R, epn, B, seed):
    """experts_to_copy of a skewed plan (some slots empty)."""
    g = torch.Generator().manual_seed(seed)
    E, S, K = R * epn, 64, 4
    pop = torch.rand(E, generator=g) ** 4 + 1e-3
    counts = torch.stack([torch.bincount(torch.multinomial(pop, S * K, replacement=True, generator=g), minlength=E)
                          for _ in range(R)]).int()
    return planning.plan_global(counts, S, K, B, 16).experts_to_copy


def _reduce_want(etc_cpu, red, home, epn):
    """(home gradients after the reduce, on the CPU; how many (expert, projection) got copies): for every home
    expert with copies, bf16(float(home) + the copies' fp32 gradients in rank order)."""
    R, B = etc_cpu.shape
    want = [[h.clone().cpu() for h in home[r]] for r in range(R)]
    n_folded = 0
    for r in range(R):
        for i in range(epn):
            for t in range(3):
                acc, copies = want[r][t][i].float(), 0
                for d in range(R):  # rank order, fp32, then one rounding
                    for j in range(B):
                        if int(etc_cpu[d, j]) == r * epn + i:
                            acc, copies = acc + red[d][t][j].cpu(), copies + 1
                if copies:
                    want[r][t][i] = acc.to(torch.bfloat16)
                    n_folded += 1
    return want, n_folded


def _peers(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device="cuda")


@needs_cuda
@pytest.mark.parametrize("R,epn,B,H,F", [(1, 4, 4, 64, 40), (2, 4, 4, 64, 48), (4, 3, 3, 72, 16), (2, 2, 2, 256, 136)])
def test_prefetch_reduce_simulated(R, epn, B, H, F):
    from csrc_cute import weights

    dev = "cuda"
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    torch.manual_seed(R * 100 + epn)
    etc_cpu = _plan_slots(R, epn, B, seed=R + epn)
    if R > 1:
        assert int((etc_cpu >= 0).sum()) > 0, "the plan should copy something"
    etc = etc_cpu.to(dev)
    shapes = ((H, F), (H, F), (F, H))
    w = [[torch.randn(epn, *s, device=dev).to(torch.bfloat16) for s in shapes] for _ in range(R)]
    sentinel = torch.tensor(7.0, dtype=torch.bfloat16)
    pools = [[torch.full((B, *s), 7.0, device=dev, dtype=torch.bfloat16) for s in shapes] for _ in range(R)]
    peer_pools = [_peers([pools[r][t] for r in range(R)]) for t in range(3)]
    for r in range(R):
        weights.prefetch_push(*w[r], etc, *peer_pools, r, status, num_ctas=3)
    torch.cuda.synchronize()
    for d in range(R):
        for j in range(B):
            e = int(etc_cpu[d, j])
            for t in range(3):
                got = pools[d][t][j].cpu()
                if e < 0:
                    assert bool((got == sentinel).all()), (d, j, t)  # empty slots untouched
                else:
                    assert torch.equal(got, w[e // epn][t][e % epn].cpu()), (d, j, t, e)

    red = [[torch.randn(B, *s, device=dev) for s in shapes] for _ in range(R)]  # fp32 copy gradients
    home = [[torch.randn(epn, *s, device=dev).to(torch.bfloat16) for s in shapes] for _ in range(R)]
    want, n_folded = _reduce_want(etc_cpu, red, home, epn)
    if R > 1:
        assert n_folded > 0
    red_before = [[b.clone().cpu() for b in red[r]] for r in range(R)]
    peer_red = [_peers([red[r][t] for r in range(R)]) for t in range(3)]
    for r in range(R):
        weights.reduce_pull(etc, *peer_red, *home[r], r, status, num_ctas=5)
    torch.cuda.synchronize()
    for r in range(R):
        for t in range(3):
            # bitwise: the same fp32 adds in the same order, one round-to-nearest-even; experts without
            # copies keep their values
            assert torch.equal(home[r][t].cpu(), want[r][t]), (r, t)
    for r in range(R):
        weights.reduce_zero(etc, *red[r], r, num_ctas=2)
    torch.cuda.synchronize()
    for r in range(R):
        for j in range(B):
            for t in range(3):
                got = red[r][t][j].cpu()
                if int(etc_cpu[r, j]) >= 0:
                    assert not got.any(), (r, j, t)
                else:
                    assert torch.equal(got, red_before[r][t][j]), (r, j, t)
    assert int(status) == 0  # a valid table (empty slots -1) sets no bit


@needs_cuda
def test_prefetch_graph_replay():
    from csrc_cute import weights

    dev, R, epn, B, H, F = "cuda", 2, 4, 4, 64, 48
    etc = _plan_slots(R, epn, B, seed=3).to(dev)
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    shapes = ((H, F), (H, F), (F, H))
    w = [[torch.randn(epn, *s, device=dev).to(torch.bfloat16) for s in shapes] for _ in range(R)]
    pools = [[torch.zeros(B, *s, device=dev, dtype=torch.bfloat16) for s in shapes] for _ in range(R)]
    peer_pools = [_peers([pools[r][t] for r in range(R)]) for t in range(3)]
    for r in range(R):
        weights.prefetch_push(*w[r], etc, *peer_pools, r, status)
    torch.cuda.synchronize()
    want = [[p.clone() for p in pools[r]] for r in range(R)]
    for r in range(R):
        for p in pools[r]:
            p.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(R):
            weights.prefetch_push(*w[r], etc, *peer_pools, r, status)
    graph.replay()
    torch.cuda.synchronize()
    for r in range(R):
        for p, q in zip(pools[r], want[r]):
            assert torch.equal(p, q)


@needs_cuda
def test_bad_copy_table_is_flagged():
    """experts_to_copy entries outside [-1, E) (an expert id >= E, or below -1) are skipped exactly like empty
    slots by prefetch_push and reduce_pull and set STATUS_BAD_TABLE in every rank's status word (each rank
    scans the whole table); empty slots (-1) alone set nothing; the canaries around every pool, home gradient
    and reduce buffer stay byte-identical; check_status raises with the BAD_TABLE message. The shape and CTA
    counts of test_prefetch_reduce_simulated's R=2 case (no new compiles)."""
    import re

    from csrc_cute import weights
    from csrc_cute.status import MESSAGES, STATUS_BAD_TABLE
    from moonep_ops.status import MoEStatusError, check_status

    dev, R, epn, B, H, F = "cuda", 2, 4, 4, 64, 48
    E = R * epn
    shapes = ((H, F), (H, F), (F, H))
    torch.manual_seed(11)
    good = _plan_slots(R, epn, B, seed=R + epn)
    good[R - 1, B - 1] = -1  # at least one empty slot
    bad = good.clone()
    bad[0, 0] = E
    bad[1, 1] = -2
    bad[1, 2] = E + 3 * epn
    dropped = torch.where((bad < -1) | (bad >= E), torch.full_like(bad, -1), bad)  # the skipped entries as empty
    guard = Canaries()

    def guarded(lead, shape, dtype, fill):
        t = guard.empty((lead, *shape), dtype, dev)
        t.copy_(fill(t))
        return t

    w = [[torch.randn(epn, *s, device=dev).to(torch.bfloat16) for s in shapes] for _ in range(R)]
    status = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(R)]

    def run(etc_cpu):
        """prefetch, reduce_pull and reduce_zero with `etc_cpu` on every rank, on fresh guarded buffers;
        returns (pools, home gradients before, after, reduce buffers)."""
        etc = etc_cpu.to(dev)
        for st in status:
            st.zero_()
        pools = [[guarded(B, s, torch.bfloat16, lambda t: torch.full_like(t, 7.0)) for s in shapes] for _ in range(R)]
        red = [[guarded(B, s, torch.float32, torch.randn_like) for s in shapes] for _ in range(R)]
        home = [[guarded(epn, s, torch.bfloat16, torch.randn_like) for s in shapes] for _ in range(R)]
        before = [[h.clone() for h in home[r]] for r in range(R)]
        peer_pools = [_peers([pools[r][t] for r in range(R)]) for t in range(3)]
        peer_red = [_peers([red[r][t] for r in range(R)]) for t in range(3)]
        for r in range(R):
            weights.prefetch_push(*w[r], etc, *peer_pools, r, status[r], num_ctas=3)
        for r in range(R):
            weights.reduce_pull(etc, *peer_red, *home[r], r, status[r], num_ctas=5)
        red_read = [[b.clone() for b in red[r]] for r in range(R)]
        for r in range(R):
            weights.reduce_zero(etc, *red[r], r, num_ctas=2)
        torch.cuda.synchronize()
        guard.check()
        return pools, before, home, red_read

    run(good)
    assert [int(st) for st in status] == [0] * R
    pools, before, home, red = run(bad)
    assert [int(st) for st in status] == [STATUS_BAD_TABLE] * R
    for d in range(R):
        for j in range(B):
            e = int(dropped[d, j])
            for t in range(3):
                got = pools[d][t][j].cpu()
                if e < 0:
                    assert bool((got == 7.0).all()), (d, j, t)  # skipped like an empty slot
                else:
                    assert torch.equal(got, w[e // epn][t][e % epn].cpu()), (d, j, t, e)
    want, _ = _reduce_want(dropped, red, before, epn)
    for r in range(R):
        for t in range(3):
            assert torch.equal(home[r][t].cpu(), want[r][t]), (r, t)
    for r in range(R):
        with pytest.raises(MoEStatusError, match=re.escape(MESSAGES[STATUS_BAD_TABLE])):
            check_status(status[r], "prefetch_weights")
        assert int(status[r]) == 0
