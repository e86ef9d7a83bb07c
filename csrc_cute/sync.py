"""Cross-rank synchronisation of the EP group in CuTe DSL: barriers over NVLink and the count exchange.

Every rank owns a symmetric int32 control block (layout in `csrc_cute/status.py`). A barrier is one CTA:
thread t release-stores the new epoch into rank t's signal slot for this rank, then acquire-spins on
this rank's slot of rank t until it holds that epoch. Epochs only grow, so no slot is ever reset and a
barrier needs no second phase; the epoch lives on the device (advanced by the barrier itself), so
repeated launches and CUDA-graph replays stay in step as long as every rank runs the same ops in the
same order. The signal word also carries the op id of the barrier ((epoch << 8) | op id, one store), so
a waiter that sees a peer at the same epoch from another op (a rank skipped or repeated an op) ORs
STATUS_OP_MISMATCH and records both ids in MISMATCH_WORD; epochs are then compared modulo 2**24. A wait that outlives the timeout ORs STATUS_TIMEOUT into the status word and returns
instead of spinning forever. Plain peer pointers and system-scope acquire/release only (no multicast).

Kernels (sm_90a, launched through the apache-tvm-ffi fast path, compiled once per static shape):
  barrier          signal every peer, wait for every peer.
  exchange_counts  push this rank's row of the count matrix into every peer's control block (landing
                   zone of this barrier's epoch parity), barrier, then copy the peers' rows out into
                   this rank's count matrix: every rank then holds all R rows and plans the same plan.
"""

# (no `from __future__ import annotations`: the DSL reads Constexpr annotations at runtime)

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from moonep_ops.checks import need_peers, need_rank, need_tensor

from .jit import KernelFamily, compiler
from .status import (DEFAULT_TIMEOUT_S, EPOCH_WORD, MISMATCH_WORD, OP_IDS, SIGNAL_BASE, STATUS_OP_MISMATCH,
                     STATUS_TIMEOUT, STATUS_WORD, control_words, counts_base)
from .warp import ptr

_NT = 256  # threads of the one-CTA sync kernels


@dsl_user_op
def _globaltimer(*, loc=None, ip=None) -> Int64:
    """The GPU's nanosecond clock (%globaltimer)."""
    return Int64(llvm.inline_asm(
        T.i64(), [], "mov.u64 $0, %globaltimer;", "=l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def _peer_word(peer_ctrl: cute.Tensor, r, i):
    """Address of word i of rank r's control block."""
    base = cute.make_ptr(Int32, peer_ctrl[r], cute.AddressSpace.gmem, assumed_align=4)
    return (base + i).llvm_ptr


@cute.jit
def signal_and_wait(peer_ctrl: cute.Tensor, ctrl: cute.Tensor, rank: Int32, timeout_ns: Int64, op_id: Int32,
                    R: Constexpr[int], NT: Constexpr[int], check_op: Constexpr[bool] = True):
    """The barrier, run by every thread of exactly one CTA (which must not have diverged). Every write
    this CTA made before the call, local or remote, is visible to every peer once it passes. `op_id`
    (csrc_cute/status.py OP_IDS, < 256) names the op; a peer met at this epoch from another op sets
    STATUS_OP_MISMATCH. Every op runs with check_op; only bench_op_overhead compiles it out, to time
    what the check itself costs."""
    tidx, _, _ = cute.arch.thread_idx()
    epoch = ctrl[EPOCH_WORD] + 1
    mark = epoch << 8  # the epoch in the signal word's upper 24 bits
    cute.arch.sync_threads()  # all threads read the epoch before thread 0 advances it below
    cute.arch.fence_acq_rel_sys()
    for t in cutlass.range(tidx, R, NT):
        cute.arch.store(_peer_word(peer_ctrl, t, SIGNAL_BASE + rank), mark | op_id, sem="release", scope="sys")
    for t in cutlass.range(tidx, R, NT):
        start = _globaltimer()
        seen = cute.arch.load(ptr(ctrl, SIGNAL_BASE + t), Int32, sem="acquire", scope="sys")
        pending = (seen & Int32(-256)) - mark < 0  # epochs compared by difference: wrap-around safe
        while pending:
            seen = cute.arch.load(ptr(ctrl, SIGNAL_BASE + t), Int32, sem="acquire", scope="sys")
            elapsed = _globaltimer() - start
            behind = (seen & Int32(-256)) - mark < 0
            if behind & (elapsed > timeout_ns):
                cute.arch.atomic_or(ptr(ctrl, STATUS_WORD), Int32(STATUS_TIMEOUT))
            pending = behind & (elapsed <= timeout_ns)
        if cutlass.const_expr(check_op):
            # a peer one barrier ahead has overwritten this barrier's id: it checked ours when it passed
            if ((seen & Int32(-256)) == mark) & ((seen & Int32(255)) != op_id):
                cute.arch.atomic_or(ptr(ctrl, STATUS_WORD), Int32(STATUS_OP_MISMATCH))
                ctrl[MISMATCH_WORD] = (op_id << 16) | (seen & Int32(255))
    cute.arch.sync_threads()
    if tidx == 0:
        ctrl[EPOCH_WORD] = epoch


@cute.kernel
def _barrier_kernel(peer_ctrl: cute.Tensor, ctrl: cute.Tensor, rank: Int32, timeout_ns: Int64, op_id: Int32,
                    R: Constexpr[int], NT: Constexpr[int], check_op: Constexpr[bool]):
    signal_and_wait(peer_ctrl, ctrl, rank, timeout_ns, op_id, R, NT, check_op)


@cute.kernel
def _exchange_counts_kernel(peer_ctrl: cute.Tensor, ctrl: cute.Tensor, counts: cute.Tensor, rank: Int32,
                            timeout_ns: Int64, R: Constexpr[int], E: Constexpr[int], NT: Constexpr[int]):
    tidx, _, _ = cute.arch.thread_idx()
    parity = (ctrl[EPOCH_WORD] + 1) & 1  # the epoch the barrier below will pass
    zone = counts_base(R, E) + parity * (R * E)
    for i in cutlass.range(tidx, R * E, NT, unroll=4):
        r = i // E
        if r != rank:
            j = i - r * E
            cute.arch.store(_peer_word(peer_ctrl, r, zone + rank * E + j), counts[rank * E + j])
    signal_and_wait(peer_ctrl, ctrl, rank, timeout_ns, Int32(OP_IDS["plan"]), R, NT)
    for i in cutlass.range(tidx, R * E, NT, unroll=4):
        if i // E != rank:
            counts[i] = ctrl[zone + i]


@cute.jit
def _barrier_launch(peer_ctrl: cute.Tensor, ctrl: cute.Tensor, rank: Int32, timeout_ns: Int64, op_id: Int32,
                    stream, R: Constexpr[int], check_op: Constexpr[bool]):
    _barrier_kernel(peer_ctrl, ctrl, rank, timeout_ns, op_id, R, _NT, check_op).launch(
        grid=(1, 1, 1), block=(_NT, 1, 1), stream=stream)


@cute.jit
def _exchange_counts_launch(peer_ctrl: cute.Tensor, ctrl: cute.Tensor, counts: cute.Tensor, rank: Int32,
                            timeout_ns: Int64, stream, R: Constexpr[int], E: Constexpr[int]):
    _exchange_counts_kernel(peer_ctrl, ctrl, counts, rank, timeout_ns, R, E, _NT).launch(
        grid=(1, 1, 1), block=(_NT, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# compile cache and host wrappers
# ------------------------------------------------------------------------------------------------
_JIT = KernelFamily("sync", (__name__,))


@compiler
def _compile(kind: str, R: int, E: int):
    """kind: "barrier", "exchange", or "barrier_unchecked" (the barrier without the op-id check: only
    bench_op_overhead runs it)."""
    def build():
        peers = cute.runtime.make_fake_compact_tensor(Int64, (R,), assumed_align=8)
        ctrl = cute.runtime.make_fake_compact_tensor(Int32, (control_words(R, E),), assumed_align=16)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        if kind in ("barrier", "barrier_unchecked"):
            return cute.compile(_barrier_launch, peers, ctrl, Int32(0), Int64(0), Int32(0), stream, R,
                                kind == "barrier", options="--enable-tvm-ffi")
        counts = cute.runtime.make_fake_compact_tensor(Int32, (R * E,), assumed_align=4)
        return cute.compile(_exchange_counts_launch, peers, ctrl, counts, Int32(0), Int64(0), stream, R, E,
                            options="--enable-tvm-ffi")
    return _JIT.compiled((kind, R, E), build)


def _check(peer_ctrl: torch.Tensor, ctrl: torch.Tensor, rank: int, E: int) -> int:
    R = need_peers("peer_ctrl", peer_ctrl)
    need_tensor("ctrl", ctrl, (torch.int32,), shape=(control_words(R, E),), device=peer_ctrl.device)
    need_rank(rank, R)
    return R


def _timeout_ns(timeout_s: float) -> int:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return int(timeout_s * 1e9)


def barrier(peer_ctrl: torch.Tensor, ctrl: torch.Tensor, rank: int, E: int,
            timeout_s: float = DEFAULT_TIMEOUT_S, op: str = "plan") -> None:
    """Cross-rank barrier on the current stream (no host sync) of the moonep op `op` (a key of OP_IDS)."""
    R = _check(peer_ctrl, ctrl, rank, E)
    if op not in OP_IDS:
        raise ValueError(f"op must be one of {sorted(OP_IDS)}, got {op!r}")
    _compile("barrier", R, E)(peer_ctrl, ctrl, rank, _timeout_ns(timeout_s), OP_IDS[op])


def exchange_counts(peer_ctrl: torch.Tensor, ctrl: torch.Tensor, counts: torch.Tensor, rank: int,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """counts int32 [R, E] holding this rank's row -> every rank's rows (NVLink, then a barrier)."""
    R = need_peers("peer_ctrl", peer_ctrl)
    need_tensor("counts", counts, (torch.int32,), shape=(R, None), device=peer_ctrl.device)
    E = counts.shape[1]
    _check(peer_ctrl, ctrl, rank, E)
    _compile("exchange", R, E)(peer_ctrl, ctrl, counts.view(-1), rank, _timeout_ns(timeout_s))


def compile_all_for_check(configs=((2, 96), (8, 384), (64, 2048)), kinds=("barrier", "exchange")) -> None:
    """Compile the sync kernels of `kinds` (see _compile) for each (R, E) without a GPU (see
    csrc_cute/compile_check.py)."""
    from csrc_cute.compile_check import compile_and_report

    for R, E in configs:
        for kind in kinds:
            compile_and_report(f"{kind} R={R} E={E}", lambda: _compile(kind, R, E))
