"""The cross-rank barrier (csrc_cute/sync.py) and its op-id check.

CPU (CI): the sync kernels compile for sm_90a without spills; the barrier compiled without the op-id
check (what bench_op_overhead times it against) lacks exactly the mismatch branch. GPU (skipped without
CUDA): two ranks simulated on one GPU (two control blocks, one stream each, so the two one-CTA barriers
spin side by side): matching ops pass and advance the epoch, different ops set STATUS_OP_MISMATCH on both
ranks with both op ids recorded, and a rank that never arrives leaves its peer with STATUS_TIMEOUT
within the timeout instead of a hang.
"""

import time

import pytest
import torch

from csrc_cute.status import (EPOCH_WORD, MISMATCH_WORD, OP_IDS, STATUS_OP_MISMATCH, STATUS_TIMEOUT,
                              STATUS_WORD, control_words)
from kernel_compile import check_module_compiles

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_sync_kernels_compile_sm90a():
    """The barrier and the count exchange (csrc_cute/sync.py) compile for sm_90a without spills."""
    configs = [[2, 96], [8, 384], [64, 2048]]
    check_module_compiles("csrc_cute.sync:compile_all_for_check", ("_barrier_kernel", "_exchange_counts_kernel"),
                          len(configs), kwargs={"configs": configs})


def test_unchecked_barrier_drops_only_the_op_id_check(tmp_path):
    """bench_op_overhead times the barrier against itself compiled without the op-id check: that variant
    lacks exactly the mismatch branch (one atomic OR and the MISMATCH_WORD store), the rest is the same."""
    from csrc_cute import compile_check

    if compile_check.find_ptxas() is None:
        pytest.skip("ptxas not found")
    ptx = {}
    for kind in ("barrier", "barrier_unchecked"):
        res = compile_check.run_compile_check("csrc_cute.sync:compile_all_for_check", str(tmp_path / kind),
                                              kwargs={"configs": [[1, 48]], "kinds": [kind]})
        (path,) = res.ptx
        ptx[kind] = open(path).read()
    atomics = {k: p.count("atom.global.or") + p.count("red.global.or") for k, p in ptx.items()}
    assert atomics == {"barrier": 2, "barrier_unchecked": 1}, atomics  # timeout + mismatch vs timeout only
    assert ptx["barrier"].count("st.global") == ptx["barrier_unchecked"].count("st.global") + 1


def _barriers_on_two_simulated_ranks(ops_by_rank, timeout_s: float = 5.0) -> tuple[list[list[int]], float]:
    """Rank r runs the barriers of ops_by_rank[r] (op names) on its own stream over two control blocks on
    one GPU; returns each rank's control words [status, epoch, mismatch] and the seconds until both ended."""
    from csrc_cute import sync

    R, E = 2, 8
    ctrl = [torch.zeros(control_words(R, E), dtype=torch.int32, device="cuda") for _ in range(R)]
    peer_ctrl = torch.tensor([c.data_ptr() for c in ctrl], dtype=torch.int64, device="cuda")
    sync._compile("barrier", R, E)  # compiled before anything spins
    streams = [torch.cuda.Stream() for _ in range(R)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for r in range(R):
        with torch.cuda.stream(streams[r]):
            for op in ops_by_rank[r]:
                sync.barrier(peer_ctrl, ctrl[r], r, E, timeout_s, op)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    return [[int(c[w]) for w in (STATUS_WORD, EPOCH_WORD, MISMATCH_WORD)] for c in ctrl], seconds


@needs_cuda
def test_barrier_same_ops_pass_on_simulated_ranks():
    words, _ = _barriers_on_two_simulated_ranks([["dispatch", "combine", "plan"]] * 2)
    assert words == [[0, 3, 0], [0, 3, 0]]


@needs_cuda
def test_barrier_different_ops_flag_both_ranks():
    """Rank 0 in dispatch meets rank 1 in combine at the same epoch: both flag the mismatch and record
    (own op id << 16) | the peer's; neither waits for the timeout."""
    words, seconds = _barriers_on_two_simulated_ranks([["dispatch"], ["combine"]])
    d, c = OP_IDS["dispatch"], OP_IDS["combine"]
    assert words == [[STATUS_OP_MISMATCH, 1, (d << 16) | c], [STATUS_OP_MISMATCH, 1, (c << 16) | d]]
    assert seconds < 2.0


@needs_cuda
def test_barrier_without_its_peer_times_out():
    """Rank 1 skips the op: rank 0's barrier gives up after the timeout with STATUS_TIMEOUT and returns."""
    words, seconds = _barriers_on_two_simulated_ranks([["dispatch"], []], timeout_s=0.2)
    assert words[0][0] == STATUS_TIMEOUT and words[0][1] == 1
    assert words[1] == [0, 0, 0]
    assert 0.2 <= seconds < 3.0
