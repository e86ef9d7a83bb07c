"""The weight path of the copied experts as CuTe DSL CUDA kernels: prefetch and gradient reduce.

Semantics (R ranks, B slots, epn home experts per rank, `experts_to_copy` [R, B] int32, -1 = empty):
  prefetch_push  for every slot (d, j) whose expert e has this rank as home: the gate, up and down
                 weights of e (this rank's w[e - rank*epn]) are written into slot j of rank d's pools
                 (remote writes over NVLink, 16-byte vectors). Empty slots are left as they are.
  reduce_pull    for every home expert i of this rank with copies: home[i] = bf16(float(home[i]) +
                 reduce[j] of every rank d (ascending) that holds a copy of it in slot j), the sum in
                 fp32 registers, one rounding (the home gradients are bf16, the reduce buffers fp32;
                 remote reads). One lane owns a chunk for all copies, so the sum order is fixed:
                 bitwise deterministic. Home experts without copies are not touched.
  reduce_zero    this rank zeroes its used reduce slots (after every home rank has read them).
The caller runs the cross-rank barriers around these kernels (moonep_ops/ops.py).

Table checks: an entry of experts_to_copy outside [-1, E = R*epn) is skipped (it names no home expert,
so nothing is copied, read or folded for it) and ORs STATUS_BAD_TABLE into `status` (the EP group's
status word, int32 [1]; no host sync), once per entry: prefetch_push flags it while warp 0 of the first
CTA lists the work, reduce_pull while the first CTA fills its slot tables. The rank and slot of an entry
are its position in the [R, B] table, never out of range. reduce_zero takes no status: it indexes only
this rank's own slots by position, and it runs after reduce_pull on the same table in the same op.

Kernels (sm_90a, persistent grids of `num_ctas` CTAs, apache-tvm-ffi fast path, compiled once per
static key): each CTA first lists the copies that are this rank's work (warp 0 compacts the table into
shared memory with ballots, in table order, so every CTA builds the same list); the work items are then
(listed copy, projection, segment of 32*U 16-byte chunks), one warp per item, grid-stride. So prefetch
and reduce_zero cost n copies' bytes and n * 3 * segments items, never B or R*B of them: a plan without
copies runs one table scan and stops. reduce_pull moves only the copied experts' bytes too, but walks
every home expert's items (skipping those without copies after one shared-memory read). At R = 1 the
host skips prefetch and reduce_grad altogether (one rank never copies).
"""

# (no `from __future__ import annotations`: the DSL reads Constexpr annotations at runtime)

import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64

from moonep_ops.checks import need_int, need_peers, need_rank, need_status, need_tensor

from .dispatch import (ROW_DTYPES, addr_of, chunk_offsets, copy_segment, fake, fake_stream, flag_bad_table,
                       row_geometry, vec_tensor, zero_segment)
from .jit import KernelFamily, compiler
from .warp import lanemask_lt
from .status import DEFAULT_COMM_SMS as DEFAULT_NUM_CTAS

_NT = 256  # threads per CTA
_U = 8     # 16-byte chunks per lane per segment


def _geometry(EB: int, U: int):
    """An expert tensor of EB bytes as segments of 32*U 16-byte chunks: (NC, nfull, UT, clamp, NSEG)
    (see dispatch.row_geometry; NSEG counts the tail segment of UT chunks per lane, if any)."""
    NC, nfull, UT, clamp = row_geometry(EB, U)
    return NC, nfull, UT, clamp, nfull + (1 if UT > 0 else 0)


def _warp_grid(NT: int, NCTA: int):
    """(lane, this warp's index in the grid, warps in the grid): one work item per warp, grid-stride."""
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    NW = NT // 32
    return cute.arch.lane_idx(), bx * NW + tidx // 32, NCTA * NW


def _split(item, NSEG: int):
    """A work item -> (slot or expert, projection 0..2, segment)."""
    outer = item // (3 * NSEG)
    rest = item - outer * (3 * NSEG)
    t = rest // NSEG
    return outer, t, rest - t * NSEG


@cute.jit
def _on_segment(op, bufs, seg, lane, U: Constexpr[int], NC: Constexpr[int], nfull: Constexpr[int],
                UT: Constexpr[int], clamp: Constexpr[bool]):
    """``op(*bufs, first chunk, lane, chunks per lane, NC, clamp)`` on segment ``seg`` of a block:
    U chunks per lane on the full segments, UT (clamped) on the last, partial one."""
    if seg < nfull:
        op(*bufs, seg * (32 * U), lane, U, NC, False)
    else:
        op(*bufs, nfull * (32 * U), lane, UT, NC, clamp)


def _bad_copy(e, E: int):
    """Whether an experts_to_copy entry is neither -1 (empty slot) nor an expert id in [0, E)."""
    return (e < -1) | (e >= E)


def _pick(t, a0, a1, a2):
    """a0, a1 or a2 by the projection index t (0 gate, 1 up, 2 down)."""
    return cutlass.select_(t == 0, a0, cutlass.select_(t == 1, a1, a2))


def _alloc_work_list(smem, n: int):
    """Shared memory for `_list_work`: (list of n indices, count)."""
    return (smem.allocate_tensor(Int32, cute.make_layout(n), byte_alignment=16),
            smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4))


@cute.jit
def _list_work(work: cute.Tensor, count: cute.Tensor, is_work, n: Constexpr[int], flag=None):
    """The indices i in [0, n) with ``is_work(i)``, in ascending order, compacted by warp 0 into the
    shared `work` list (`_alloc_work_list`); returns their count, after a CTA barrier. Ascending order
    makes every CTA's list the same, so the grid-stride split of the listed items covers each exactly
    once. ``flag(i, valid)`` (optional) is called on the same indices (``valid``: i < n), to check the
    entries while they are read."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    if tidx < 32:
        base = Int32(0)
        for c0 in cutlass.range(0, n, 32):
            i = c0 + lane
            hit = (i < n) & is_work(cutlass.min(i, Int32(n - 1)))
            if cutlass.const_expr(flag is not None):
                flag(cutlass.min(i, Int32(n - 1)), i < n)
            m = cute.arch.vote_ballot_sync(hit)
            if hit:
                work[base + cute.arch.popc(m & lanemask_lt())] = i
            base = base + cute.arch.popc(m)
        if lane == 0:
            count[0] = base
    cute.arch.sync_threads()
    return count[0]


@cute.kernel
def _prefetch_kernel(etc: cute.Tensor, w_gate: cute.Tensor, w_up: cute.Tensor, w_down: cute.Tensor,
                     peer_gate: cute.Tensor, peer_up: cute.Tensor, peer_down: cute.Tensor, status: cute.Tensor,
                     rank: Int32, R: Constexpr[int], B: Constexpr[int], EPN: Constexpr[int], EB: Constexpr[int],
                     NCTA: Constexpr[int], NT: Constexpr[int], U: Constexpr[int]):
    NC, nfull, UT, clamp, NSEG = _geometry(EB, U)
    lane, gw, nwarps = _warp_grid(NT, NCTA)
    bases = (addr_of(w_gate), addr_of(w_up), addr_of(w_down))
    # the slots (d, j) of every rank that hold a copy of one of this rank's home experts
    mine, count = _alloc_work_list(cutlass.utils.SmemAllocator(), R * B)
    bx, _, _ = cute.arch.block_idx()
    n = _list_work(mine, count, lambda p: (etc[p] >= 0) & (etc[p] // EPN == rank), R * B,
                   lambda p, valid: flag_bad_table(status, (bx == 0) & valid & _bad_copy(etc[p], R * EPN)))
    for item in cutlass.range(gw, n * 3 * NSEG, nwarps):
        w, t, seg = _split(item, NSEG)
        p = mine[w]
        e = etc[p]
        d = p // B
        src = _pick(t, *bases) + Int64(e - rank * EPN) * EB
        dst = _pick(t, peer_gate[d], peer_up[d], peer_down[d]) + Int64(p - d * B) * EB
        _on_segment(copy_segment, (src, dst), seg, lane, U, NC, nfull, UT, clamp)


@cute.kernel
def _reduce_pull_kernel(etc: cute.Tensor, peer_gate: cute.Tensor, peer_up: cute.Tensor, peer_down: cute.Tensor,
                        home_gate: cute.Tensor, home_up: cute.Tensor, home_down: cute.Tensor, status: cute.Tensor,
                        rank: Int32, R: Constexpr[int], B: Constexpr[int], EPN: Constexpr[int], EB: Constexpr[int],
                        NCTA: Constexpr[int], NT: Constexpr[int], U: Constexpr[int]):
    # EB: bytes of one expert's fp32 gradient (the sources); the bf16 home gradient has EB // 2
    NC, nfull, UT, clamp, NSEG = _geometry(EB, U)
    lane, gw, nwarps = _warp_grid(NT, NCTA)
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    # slot_of[i * R + d]: the slot of rank d holding a copy of home expert i, or -1 (one per rank at most);
    # has_copy[i]: whether home expert i has a copy on any rank (the others are not touched)
    smem = cutlass.utils.SmemAllocator()
    slot_of = smem.allocate_tensor(Int32, cute.make_layout(EPN * R), byte_alignment=16)
    has_copy = smem.allocate_tensor(Int32, cute.make_layout(EPN), byte_alignment=16)
    for i in cutlass.range(tidx, EPN * R, NT):
        slot_of[i] = -1
    for i in cutlass.range(tidx, EPN, NT):
        has_copy[i] = 0
    cute.arch.sync_threads()
    for p in cutlass.range(tidx, R * B, NT):
        e = etc[p]
        flag_bad_table(status, (bx == 0) & _bad_copy(e, R * EPN))
        if (e >= 0) & (e // EPN == rank):
            d = p // B
            slot_of[(e - rank * EPN) * R + d] = p - d * B
            has_copy[e - rank * EPN] = 1
    cute.arch.sync_threads()
    homes = (addr_of(home_gate), addr_of(home_up), addr_of(home_down))
    # items of home experts without copies are skipped after one shared-memory read (listing them as
    # prefetch does makes ptxas spill this kernel at small shapes)
    for item in cutlass.range(gw, EPN * 3 * NSEG, nwarps):
        i, t, seg = _split(item, NSEG)
        if has_copy[i] != 0:
            home = _pick(t, *homes) + Int64(i) * (EB // 2)
            _on_segment(_reduce_segment, (home, slot_of, i * R, t, peer_gate, peer_up, peer_down, R, EB), seg, lane,
                        U, NC, nfull, UT, clamp)


@cute.jit
def _reduce_segment(home, slot_of: cute.Tensor, row, t, peer_gate: cute.Tensor, peer_up: cute.Tensor,
                    peer_down: cute.Tensor, R: Constexpr[int], EB: Constexpr[int], c0, lane, U: Constexpr[int],
                    NC: Constexpr[int], clamp: Constexpr[bool]):
    """Over this lane's U 16-byte chunks of the fp32 gradients (4 values each; 8 bytes of the bf16 home
    gradient at half the offset): home = bf16(float(home) + the copy of every rank d holding one,
    slot_of[row + d] >= 0, added in ascending d), the sum in fp32 registers, one rounding."""
    if cutlass.const_expr(U > 0):  # U = 0: the (traced, never taken) tail of a gradient without one
        offs = chunk_offsets(c0, lane, U, NC, clamp)
        acc = cute.make_rmem_tensor((4, U), Float32)
        for u in cutlass.range_constexpr(U):
            acc[None, u].store(vec_tensor(BFloat16, home + offs[u] // 2, 4).load().to(Float32))
        for d in cutlass.range(R):
            j = slot_of[row + d]
            if j >= 0:
                src = _pick(t, peer_gate[d], peer_up[d], peer_down[d]) + Int64(j) * EB
                got = [vec_tensor(Float32, src + o, 4).load() for o in offs]
                for u in cutlass.range_constexpr(U):
                    acc[None, u].store(acc[None, u].load() + got[u])
        for u in cutlass.range_constexpr(U):
            vec_tensor(BFloat16, home + offs[u] // 2, 4).store(acc[None, u].load().to(BFloat16))


@cute.kernel
def _reduce_zero_kernel(etc: cute.Tensor, red_gate: cute.Tensor, red_up: cute.Tensor, red_down: cute.Tensor,
                        rank: Int32, B: Constexpr[int], EB: Constexpr[int], NCTA: Constexpr[int],
                        NT: Constexpr[int], U: Constexpr[int]):
    NC, nfull, UT, clamp, NSEG = _geometry(EB, U)
    lane, gw, nwarps = _warp_grid(NT, NCTA)
    bufs = (addr_of(red_gate), addr_of(red_up), addr_of(red_down))
    used, count = _alloc_work_list(cutlass.utils.SmemAllocator(), B)
    n = _list_work(used, count, lambda j: etc[rank * B + j] >= 0, B)  # this rank's used reduce slots
    for item in cutlass.range(gw, n * 3 * NSEG, nwarps):
        w, t, seg = _split(item, NSEG)
        dst = _pick(t, *bufs) + Int64(used[w]) * EB
        _on_segment(zero_segment, (dst,), seg, lane, U, NC, nfull, UT, clamp)


@cute.jit
def _prefetch_launch(etc: cute.Tensor, w_gate: cute.Tensor, w_up: cute.Tensor, w_down: cute.Tensor,
                     peer_gate: cute.Tensor, peer_up: cute.Tensor, peer_down: cute.Tensor, status: cute.Tensor,
                     rank: Int32, stream, R: Constexpr[int], B: Constexpr[int], EPN: Constexpr[int],
                     EB: Constexpr[int], NCTA: Constexpr[int]):
    _prefetch_kernel(etc, w_gate, w_up, w_down, peer_gate, peer_up, peer_down, status, rank, R, B, EPN, EB, NCTA,
                     _NT, _U).launch(grid=(NCTA, 1, 1), block=(_NT, 1, 1), stream=stream)


@cute.jit
def _reduce_pull_launch(etc: cute.Tensor, peer_gate: cute.Tensor, peer_up: cute.Tensor, peer_down: cute.Tensor,
                        home_gate: cute.Tensor, home_up: cute.Tensor, home_down: cute.Tensor,
                        status: cute.Tensor, rank: Int32, stream, R: Constexpr[int], B: Constexpr[int],
                        EPN: Constexpr[int], EB: Constexpr[int], NCTA: Constexpr[int]):
    _reduce_pull_kernel(etc, peer_gate, peer_up, peer_down, home_gate, home_up, home_down, status, rank, R, B,
                        EPN, EB, NCTA, _NT, _U).launch(grid=(NCTA, 1, 1), block=(_NT, 1, 1), stream=stream)


@cute.jit
def _reduce_zero_launch(etc: cute.Tensor, red_gate: cute.Tensor, red_up: cute.Tensor, red_down: cute.Tensor,
                        rank: Int32, stream, B: Constexpr[int], EB: Constexpr[int], NCTA: Constexpr[int]):
    _reduce_zero_kernel(etc, red_gate, red_up, red_down, rank, B, EB, NCTA, _NT, _U).launch(
        grid=(NCTA, 1, 1), block=(_NT, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# compile cache and host wrappers
# ------------------------------------------------------------------------------------------------
_JIT = KernelFamily("weights", (__name__,))


@compiler
def _compile_prefetch(R, B, epn, HF, dtype, ncta):
    dt, EB = ROW_DTYPES[dtype], HF * dtype.itemsize

    def build():
        w = [fake(dt, epn * HF) for _ in range(3)]
        peers = [fake(Int64, R, 8) for _ in range(3)]
        return cute.compile(_prefetch_launch, fake(Int32, R * B, 4), *w, *peers, fake(Int32, 1, 4), Int32(0),
                            fake_stream(),
                            R, B, epn, EB, ncta, options="--enable-tvm-ffi")
    return _JIT.compiled(("prefetch", R, B, epn, HF, dtype, ncta), build)


@compiler
def _compile_reduce(R, B, epn, HF, ncta):
    EB = HF * 4  # one expert's fp32 copy gradient; the bf16 home gradient is HF * 2 bytes

    def build():
        peers = [fake(Int64, R, 8) for _ in range(3)]
        homes = [fake(BFloat16, epn * HF) for _ in range(3)]
        return cute.compile(_reduce_pull_launch, fake(Int32, R * B, 4), *peers, *homes, fake(Int32, 1, 4), Int32(0),
                            fake_stream(),
                            R, B, epn, EB, ncta, options="--enable-tvm-ffi")
    return _JIT.compiled(("reduce_pull", R, B, epn, HF, ncta), build)


@compiler
def _compile_zero(R, B, HF, ncta):
    EB = HF * 4

    def build():
        bufs = [fake(Float32, B * HF) for _ in range(3)]
        return cute.compile(_reduce_zero_launch, fake(Int32, R * B, 4), *bufs, Int32(0), fake_stream(), B, EB,
                            ncta, options="--enable-tvm-ffi")
    return _JIT.compiled(("reduce_zero", R, B, HF, ncta), build)


def _check_weights(name, tensors, dtypes, lead, device):
    """Three [lead, H, F] / [lead, H, F] / [lead, F, H] tensors (gate, up, down); lead None: the gate's.
    Returns (lead, H*F)."""
    g = need_tensor(f"{name}_gate", tensors[0], dtypes, shape=(lead, None, None), device=device)
    lead, H, F = g.shape
    need_tensor(f"{name}_up", tensors[1], (g.dtype,), shape=(lead, H, F), device=device)
    need_tensor(f"{name}_down", tensors[2], (g.dtype,), shape=(lead, F, H), device=device)
    if H * F * g.dtype.itemsize % 16:
        raise ValueError(f"{name}: H*F*itemsize must be a multiple of 16 bytes, got H={H}, F={F}")
    return lead, H * F


def _check_table(experts_to_copy, peers, device):
    etc = need_tensor("experts_to_copy", experts_to_copy, (torch.int32,), ndim=2, device=device)
    R, B = etc.shape
    for name, t in peers.items():
        need_peers(name, t, R, device)
    return R, B


def prefetch_push(w_gate, w_up, w_down, experts_to_copy, peer_pool_gate, peer_pool_up, peer_pool_down, rank: int,
                  status, num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Push this rank's planned expert copies into the destination ranks' slot pools. status int32 [1]:
    STATUS_BAD_TABLE is OR-ed in for an entry of experts_to_copy outside [-1, E) (skipped)."""
    dev = w_gate.device
    R, B = _check_table(experts_to_copy, dict(peer_pool_gate=peer_pool_gate, peer_pool_up=peer_pool_up,
                                              peer_pool_down=peer_pool_down), dev)
    epn, HF = _check_weights("w", (w_gate, w_up, w_down), tuple(ROW_DTYPES), None, dev)
    rank, num_ctas = need_rank(rank, R), need_int("num_ctas", num_ctas)
    need_status(status, dev)
    fn = _compile_prefetch(R, B, epn, HF, w_gate.dtype, num_ctas)
    fn(experts_to_copy.view(-1), w_gate.view(-1), w_up.view(-1), w_down.view(-1), peer_pool_gate, peer_pool_up,
       peer_pool_down, status, rank)


def reduce_pull(experts_to_copy, peer_reduce_gate, peer_reduce_up, peer_reduce_down, home_gate, home_up, home_down,
                rank: int, status, num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """For every home expert i with copies: home[i] = bf16(float(home[i]) + every copy's fp32 gradient, in
    ascending rank order), the copies read from the ranks that computed them (their fp32 reduce
    buffers); one rounding. The home gradients are bf16 [epn, H, F] / [epn, F, H]. status int32 [1]:
    STATUS_BAD_TABLE is OR-ed in for an entry of experts_to_copy outside [-1, E) (skipped)."""
    dev = home_gate.device
    R, B = _check_table(experts_to_copy, dict(peer_reduce_gate=peer_reduce_gate, peer_reduce_up=peer_reduce_up,
                                              peer_reduce_down=peer_reduce_down), dev)
    epn, HF = _check_weights("home", (home_gate, home_up, home_down), (torch.bfloat16,), None, dev)
    rank, num_ctas = need_rank(rank, R), need_int("num_ctas", num_ctas)
    need_status(status, dev)
    if 4 * epn * (R + 1) > 48 * 1024:
        raise ValueError(f"epn*(R+1)={epn * (R + 1)}: the slot tables must fit 48 KiB of shared memory")
    if HF % 128:
        raise ValueError(f"home: H*F must be a multiple of 128 (fp32 gradients are added in whole 32-lane "
                         f"steps of 16-byte chunks), got H*F={HF}")
    fn = _compile_reduce(R, B, epn, HF, num_ctas)
    fn(experts_to_copy.view(-1), peer_reduce_gate, peer_reduce_up, peer_reduce_down, home_gate.view(-1),
       home_up.view(-1), home_down.view(-1), status, rank)


def reduce_zero(experts_to_copy, reduce_gate, reduce_up, reduce_down, rank: int,
                num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Zero this rank's used reduce slots."""
    dev = reduce_gate.device
    R, B = _check_table(experts_to_copy, {}, dev)
    _, HF = _check_weights("reduce", (reduce_gate, reduce_up, reduce_down), (torch.float32,), B, dev)
    rank, num_ctas = need_rank(rank, R), need_int("num_ctas", num_ctas)
    fn = _compile_zero(R, B, HF, num_ctas)
    fn(experts_to_copy.view(-1), reduce_gate.view(-1), reduce_up.view(-1), reduce_down.view(-1), rank)


def compile_all_for_check(configs=None, num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Compile the weight kernels for each (R, B, epn, H, F) without a GPU (see compile_check.py)."""
    from csrc_cute.compile_check import compile_and_report

    for R, B, epn, H, F in configs or [(2, 48, 48, 7168, 2048), (8, 4, 8, 64, 40)]:
        for kind, build in (("prefetch", lambda: _compile_prefetch(R, B, epn, H * F, torch.bfloat16, num_ctas)),
                            ("reduce_pull", lambda: _compile_reduce(R, B, epn, H * F, num_ctas)),
                            ("reduce_zero", lambda: _compile_zero(R, B, H * F, num_ctas))):
            compile_and_report(f"{kind} R={R} B={B} epn={epn} H={H} F={F}", build)
