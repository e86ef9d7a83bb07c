"""GPU planner (CuTe DSL) against the bit-exact CPU reference `moonep_ops.planning`.

CPU (CI): every planner kernel compiles for sm_90a (no GPU needed) and ptxas reports its registers
and spills; host-side validation. GPU (skipped without CUDA): plans equal the CPU reference bit for
bit on >= 200 routings, status bits, CUDA-graph capture/replay.

Timing: benchmarks/bench_planner.py.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kernel_compile import check_module_compiles  # noqa: E402
from moonep_ops import planning  # noqa: E402
from routings import cpu_counts, lognormal_ids, routings  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


# ------------------------------------------------------------------------------------------------
# (a) CPU: compile for sm_90a, ptxas statistics
# ------------------------------------------------------------------------------------------------
def test_planner_kernels_compile_sm90a():
    configs = [
        dict(R=8, S=8192, K=8, E=384, B=48, P=128, ids="int32"),
        dict(R=64, S=8192, K=8, E=2048, B=32, P=128, ids="int64"),
        dict(R=1, S=1, K=1, E=4, B=1, P=1, ids="int32"),
    ]
    check_module_compiles("csrc_cute.plan:compile_all_for_check",
                          ("_count_kernel", "_plan_global_kernel", "_plan_expand_kernel", "_tok_hist_kernel",
                           "_tok_scan_kernel", "_tok_assign_kernel"), len(configs), kwargs={"configs": configs},
                          files_per_config=3)


def test_sync_kernels_compile_sm90a():
    """The barrier and the count exchange (csrc_cute/sync.py) compile for sm_90a without spills."""
    configs = [[2, 96], [8, 384], [64, 2048]]
    check_module_compiles("csrc_cute.sync:compile_all_for_check", ("_barrier_kernel", "_exchange_counts_kernel"),
                          len(configs), kwargs={"configs": configs})


def test_host_validation_errors():
    from csrc_cute import plan as P

    with pytest.raises(ValueError, match="topk_ids.*dtype"):
        P.count_experts(torch.zeros(4, 2, dtype=torch.float32), 8)
    with pytest.raises(ValueError, match="topk_ids.*CUDA"):
        P.count_experts(torch.zeros(4, 2, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="topk_ids.*-D"):
        P.count_experts(torch.zeros(8, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="E must be"):
        P.count_experts(torch.zeros(4, 2, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="counts.*dtype"):
        P.plan_global_cuda(torch.zeros(2, 4, dtype=torch.int64), 1, 1, 1, 1)
    with pytest.raises(ValueError, match="counts.*CUDA"):
        P.plan_global_cuda(torch.zeros(2, 4, dtype=torch.int32), 1, 1, 1, 1)
    with pytest.raises(ValueError, match="B must be"):
        P.plan_global_cuda(torch.zeros(2, 4, dtype=torch.int32), 1, 1, 0, 1)
    with pytest.raises(ValueError, match="exactly one"):
        P.plan_simulated(B=1)
    if HAS_CUDA:
        dev = "cuda"
        with pytest.raises(ValueError, match="multiple of R"):
            P.plan_global_cuda(torch.zeros(3, 4, dtype=torch.int32, device=dev), 1, 1, 1, 1)
        with pytest.raises(ValueError, match="contiguous"):
            P.plan_global_cuda(torch.zeros(4, 2, dtype=torch.int32, device=dev).t(), 1, 1, 1, 1)
        with pytest.raises(ValueError, match="K must be <= 32"):
            ids = torch.zeros(2, 33, dtype=torch.int32, device=dev)
            c = torch.zeros(1, 64, dtype=torch.int32, device=dev)
            P.plan_tokens_cuda(ids, c, torch.zeros(64, 1, dtype=torch.int32, device=dev),
                               torch.zeros(1, 1, dtype=torch.int32, device=dev),
                               torch.zeros(1, 65, dtype=torch.int32, device=dev), 0)
        with pytest.raises(ValueError, match="rank must be in"):
            ids = torch.zeros(2, 2, dtype=torch.int32, device=dev)
            c = torch.zeros(2, 4, dtype=torch.int32, device=dev)
            P.plan_tokens_cuda(ids, c, torch.zeros(4, 2, dtype=torch.int32, device=dev),
                               torch.zeros(2, 1, dtype=torch.int32, device=dev),
                               torch.zeros(2, 3, dtype=torch.int32, device=dev), 2)


# (R, S, K, E, B, P, ids dtype, number of routings used)
CONFIGS = [
    (1, 64, 4, 8, 8, 16, torch.int32, 19),
    (2, 256, 8, 96, 48, 128, torch.int64, 19),
    (2, 2048, 2, 2048, 1024, 128, torch.int32, 19),   # large epn
    (8, 512, 8, 384, 48, 128, torch.int32, 19),
    (8, 300, 6, 64, 2, 32, torch.int64, 19),          # few slots: overflow cases
    (16, 128, 4, 64, 4, 8, torch.int32, 19),
    (32, 64, 8, 256, 8, 128, torch.int64, 19),
    (64, 96, 8, 2048, 32, 128, torch.int32, 19),
    (64, 8, 1, 64, 1, 4, torch.int32, 19),            # E = R, K = 1
    (4, 1, 3, 16, 4, 2, torch.int64, 19),             # S = 1
    (8, 8192, 8, 384, 48, 128, torch.int64, 8),       # realistic
    (64, 8192, 8, 2048, 32, 128, torch.int32, 4),     # realistic, large R
]


def _eq(a, b, what):
    a = a.cpu()
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} mismatches, first at {bad[:4].tolist()}: "
                             f"gpu {[int(a[tuple(i)]) for i in bad[:4]]} cpu {[int(b[tuple(i)]) for i in bad[:4]]}")


def _check_routing(P, R, S, K, E, B, Pad, dt, name, ids_cpu, ranks):
    dev = torch.device("cuda")
    ids = ids_cpu.to(dt).to(dev).contiguous()
    counts_ref = cpu_counts(ids_cpu, E)
    try:
        ref = planning.plan_global(counts_ref, S, K, B, Pad)
    except ValueError:
        ref = None
    counts, plan, _, status = P.plan_simulated(ids, E=E, B=B, P=Pad)
    _eq(counts, counts_ref, f"{name} counts")
    st = int(status.item())
    if ref is None:
        assert st & P.STATUS_SLOT_OVERFLOW, (name, st)
        return "overflow"
    assert st == 0, (name, st)
    _eq(plan.alloc, ref.alloc, f"{name} alloc")
    _eq(plan.experts_to_copy, ref.experts_to_copy, f"{name} experts_to_copy")
    _eq(plan.cu_seqlens, ref.cu_seqlens, f"{name} cu_seqlens")
    _eq(plan.group_rows, ref.group_rows, f"{name} group_rows")
    for rank in ranks:
        tok_ref = planning.plan_tokens(ids_cpu[rank], counts_ref, ref, rank)
        tok, status = P.plan_tokens_cuda(ids[rank], counts, plan.alloc, plan.experts_to_copy,
                                         plan.cu_seqlens, rank)
        assert int(status.item()) == 0, (name, rank, int(status.item()))
        _eq(tok.dst_rank, tok_ref.dst_rank, f"{name} rank {rank} dst_rank")
        _eq(tok.dst_row, tok_ref.dst_row, f"{name} rank {rank} dst_row")
        _eq(tok.primary_row, tok_ref.primary_row, f"{name} rank {rank} primary_row")
    return "ok"


@needs_cuda
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "R{}-S{}-K{}-E{}-B{}-P{}".format(*c[:6]))
def test_cuda_plan_bitexact(cfg):
    from csrc_cute import plan as P

    R, S, K, E, B, Pad, dt, n = cfg
    rs = routings(R, S, K, E, seed=1000 * R + E + S, n=n)
    outcomes = {}
    for i, (name, ids_cpu) in enumerate(rs):
        ranks = sorted({0, R - 1, i % R})
        o = _check_routing(P, R, S, K, E, B, Pad, dt, name, ids_cpu, ranks)
        outcomes[o] = outcomes.get(o, 0) + 1
    print(f"R={R} S={S} K={K} E={E} B={B}: {outcomes}")


def test_config_routing_total():
    assert sum(c[-1] for c in CONFIGS) >= 200


@needs_cuda
def test_cuda_bad_expert_id_sets_status():
    from csrc_cute import plan as P

    R, S, K, E = 2, 16, 4, 8
    for dt in (torch.int32, torch.int64):
        ids = torch.randint(0, E, (R, S, K)).to(dt).cuda()
        ids[0, 3, 1] = -1
        ids[1, 5, 2] = E
        if dt == torch.int64:
            ids[1, 6, 0] = 2 ** 32 + 1  # must not wrap to a valid int32 id
        counts, status = P.count_experts(ids, E)
        assert int(status.item()) & P.STATUS_BAD_EXPERT_ID
        ref = torch.stack([torch.bincount(x[(x >= 0) & (x < E)], minlength=E) for x in ids.cpu().long().view(R, -1)])
        assert torch.equal(counts.cpu(), ref.int())
        single, st1 = P.count_experts(ids[0].contiguous(), E)
        assert int(st1.item()) & P.STATUS_BAD_EXPERT_ID
        assert torch.equal(single.cpu(), ref[0].int())
        # the planner sees bad row sums; plan_tokens marks the bad rows with -1
        _, plan, tok, status = P.plan_simulated(ids, E=E, B=E // R, P=4, rank=0)
        st = int(status.item())
        assert st & P.STATUS_BAD_EXPERT_ID and st & P.STATUS_BAD_COUNTS
        assert int(tok.dst_rank[3, 1]) == -1 and int(tok.dst_row[3, 1]) == -1
        assert int(tok.primary_row[3, 1]) == -1


@needs_cuda
def test_cuda_counts_mismatch_and_bad_counts():
    from csrc_cute import plan as P

    R, S, K, E = 2, 32, 2, 8
    ids = torch.randint(0, E, (R, S, K)).int().cuda()
    counts, _ = P.count_experts(ids, E)
    plan, st = P.plan_global_cuda(counts, S, K, E // R, 4)
    assert int(st.item()) == 0
    wrong = counts.clone()
    wrong[0, 0] += 1
    wrong[0, 1] -= 1
    _, st = P.plan_tokens_cuda(ids[0], wrong, plan.alloc, plan.experts_to_copy, plan.cu_seqlens, 0)
    assert int(st.item()) & P.STATUS_COUNTS_MISMATCH
    bad = counts.clone()
    bad[1, 2] += 5
    _, st = P.plan_global_cuda(bad, S, K, E // R, 4)
    assert int(st.item()) & P.STATUS_BAD_COUNTS


@needs_cuda
def test_cuda_slot_overflow_status():
    """B too small for the routing: the CPU reference raises, the GPU sets STATUS_SLOT_OVERFLOW and
    keeps every output in bounds; where the CPU does not raise, the plans are equal."""
    from csrc_cute import plan as P

    R, S, K, E, B, Pad = 8, 256, 8, 64, 1, 16
    gen = torch.Generator().manual_seed(11)
    n_over = 0
    for sigma in (0.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0):
        ids_cpu = lognormal_ids(gen, R, S, K, E, sigma)
        outcome = _check_routing(P, R, S, K, E, B, Pad, torch.int32, f"overflow{sigma}", ids_cpu, [0])
        if outcome != "overflow":
            continue
        n_over += 1
        ids = ids_cpu.int().cuda()
        _, plan, _, status = P.plan_simulated(ids, E=E, B=B, P=Pad)
        e2c = plan.experts_to_copy.cpu()
        assert bool(((e2c >= -1) & (e2c < E)).all())
        cu = plan.cu_seqlens.cpu()
        assert bool((cu[:, 1:] >= cu[:, :-1]).all()) and bool((cu >= 0).all())
        for rank in range(R):
            tok, st = P.plan_tokens_cuda(ids[rank], plan_counts(P, ids, E), plan.alloc,
                                         plan.experts_to_copy, plan.cu_seqlens, rank)
            dr = tok.dst_rank.cpu()
            assert bool(((dr >= -1) & (dr < R)).all())
            row = tok.dst_row.cpu()
            assert bool(((row == -1) == (dr == -1)).all())
            if bool((dr == -1).any()):
                assert int(st.item()) & P.STATUS_SLOT_OVERFLOW
    assert n_over >= 1


def plan_counts(P, ids, E):
    return P.count_experts(ids, E)[0]


@needs_cuda
def test_cuda_graph_capture_replay_equals_eager():
    from csrc_cute import plan as P

    R, S, K, E, B, Pad = 8, 1024, 8, 64, 8, 128
    gen = torch.Generator().manual_seed(7)
    ids0 = lognormal_ids(gen, R, S, K, E, 1.0).int().cuda()
    static_ids = ids0.clone()
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    rank = 3
    # warm up (compiles) outside the capture
    P.plan_simulated(static_ids, E=E, B=B, P=Pad, rank=rank, status=status)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        status.zero_()
        counts, plan, tok, status_out = P.plan_simulated(static_ids, E=E, B=B, P=Pad, rank=rank,
                                                         status=status)
    for sigma in (0.5, 2.0, 3.0):
        ids = lognormal_ids(gen, R, S, K, E, sigma).int().cuda()
        static_ids.copy_(ids)
        g.replay()
        torch.cuda.synchronize()
        c2, p2, t2, s2 = P.plan_simulated(ids.clone(), E=E, B=B, P=Pad, rank=rank)
        assert torch.equal(counts, c2)
        for a, b in zip(plan, p2):
            assert torch.equal(a, b)
        for a, b in zip(tok, t2):
            assert torch.equal(a, b)
        assert int(status.item()) == int(s2.item()) == 0
        ref = planning.plan_global(c2.cpu(), S, K, B, Pad)
        assert torch.equal(plan.alloc.cpu(), ref.alloc)
