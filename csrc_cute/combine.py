"""Combine data movement as CuTe DSL CUDA kernels: sum each token's duplicate rows locally, then pull
one row per (token, destination rank) from the peers and sum in k order. No barrier inside: the
caller runs a cross-rank barrier between `combine_presum` (on every rank) and `combine_pull`.

Semantics (S tokens, K top-k, R ranks, NvS rows; plan tables [S, K] int32 `dst_rank`, `dst_row`,
`primary_row` as in `moonep_ops/planning.py`; `row_primary` / `row_next` [NvS] int32 are dispatch's
`out_primary` / `out_next`):

  combine_presum  local: for every row p with row_primary[p] == p, presum[p] = the fp32 sum over the
                  chain p, row_next[p], row_next[row_next[p]], ... (until -1) of rows[...], rounded
                  to the row dtype; other rows of presum are left untouched.
  combine_pull    out[s] = the row dtype of the fp32 sum, in k order, over the k with
                  dst_row[s, k] == primary_row[s, k], of presum[dst_row[s, k]] on rank dst_rank[s, k]
                  (remote reads: one row per (token, destination rank) crosses the link).
  gather_pull     out[s, k] = vals[dst_row[s, k]] on rank dst_rank[s, k] (vals f32 [NvS] per rank);
                  0 for entries outside the plan.
  combine_local   one rank (R = 1), one pass: out[s] = the row dtype of the fp32 sum, in k order, of
                  rows[dst_row[s, k]] -- bitwise combine_presum + combine_pull there (a token's chain
                  is its rows in k order), without writing the presums and reading them back.

Every sum is a fixed-order fp32 sum (no atomics): deterministic. Chains are followed for at most 32
rows (K <= 32) and stop at a row outside [0, NvS); plan entries with a rank outside [0, R) or a row
outside [0, NvS) are skipped: dst_rank = -1 marks an absent token, whose output row is zero (combine)
and whose values are 0 (gather). Every skipped entry other than that marker ORs STATUS_BAD_TABLE into
`status` (the EP group's status word, int32 [1]; no host sync), one atomic per entry, the checks
comparing values the kernels load anyway:
  presum  a row whose row_primary is outside [-1, NvS); a chain entry (row_next of a row on a head's
          chain) outside [-1, NvS), or a chain longer than 32 rows (a cycle).
  pull    an entry (s, k) with dst_rank not -1 and outside [0, R), or a valid rank with dst_row or
          primary_row outside [0, NvS).
  gather  an entry with dst_rank not -1 and outside [0, R), or a valid rank with dst_row outside
          [0, NvS).

Kernels (sm_90a, persistent grids of `num_ctas` CTAs, apache-tvm-ffi fast path, compiled once per
static key):
  presum  one warp per 32 rows (grid-stride), a ballot finds the chain heads; items (head,
          segment of U 16-byte chunks per lane, chain row) stream through a per-warp ring of D
          slots in shared memory filled by cp.async (per-thread commit groups, no barriers: each
          lane reads back only its own chunks), D - 1 items in flight while the oldest is added in
          fp32 registers (chain order) and stored at its chain's end; a walker follows the next
          head's chain one pointer load per iteration, overlapped with the copies.
  pull    one warp per token: lanes < K hold the token's entries, a ballot of the carriers, then per
          segment the carriers' rows are read from the peers in k order (NB at a time) and summed in
          fp32. combine_local's variant (LOCAL): every valid entry is a carrier and its row is read
          from `rows` itself, 4 rows at once (NT, U and NB are _compile_pull's nt, u, nb).
  gather  one thread per (s, k), 4 independent reads in flight per thread.
"""

# (no `from __future__ import annotations`: the DSL reads Constexpr annotations at runtime)

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from moonep_ops.checks import need_int, need_peers, need_status, need_tensor

from .jit import KernelFamily, compiler
from .dispatch import (
    DEFAULT_NUM_CTAS,
    ROW_DTYPES,
    addr_of,
    align_up,
    check_fits,
    chunk_offsets,
    fake,
    flag_bad_table,
    fake_stream,
    need_plan,
    need_rows,
    need_rows_and_plan,
    row_geometry,
    vec_tensor,
    warp_coords,
)
from .warp import ctz

_NT_PRESUM = 512   # 16 warps, each with a ring of D slots of U 16-byte chunks per lane in shared memory
_NT_PULL = 512
_NT_GATHER = 256
# U: 16-byte chunks per lane per segment; NB (a power of two): rows of a chain / carriers read at once
# (blocks of NB, then of NB/2, ..., 1 row; every load of a block is issued before its adds)
_U_PRESUM, _D_PRESUM = 4, 6   # 16 warps * 6 slots * 2 KiB = 192 KiB of shared memory per CTA
_U_PULL, _NB_PULL = 8, 1
# the one-pass combine of one rank: 2 chunks a lane, a token's 8 rows' loads issued before their adds (16 16-byte
# loads of a thread outstanding, 46 registers: two 512-thread CTAs an SM). The earlier 8 chunks x 4 rows (99
# registers: one CTA an SM, and ptxas interleaved the loads with the adds, ~5 outstanding) ran as fast in a burst
# but 9% slower in the layer's step: on an H100 80GB HBM3 (session 50, results/bench_combine_session50_h100.json,
# bench_peers_session50_h100_combine_layer_ab.json) 0.403 against 0.369 ms a pass in the profiled step (SonicMoE's
# combine 0.352), 0.373 against 0.366 ms alone. benchmarks/bench_combine.py sweeps NT, U and NB through _compile_pull.
_U_LOCAL, _NB_LOCAL = 2, 8
_CHAIN_MAX = 32
_NO_NVS = 2 ** 31 - 64  # row bound when the caller gives no nvs


# ------------------------------------------------------------------------------------------------
# device helpers (straight-line)
# ------------------------------------------------------------------------------------------------
def acc_add_rows(acc, addrs, offs, dtype, VEC: int):
    """acc[:, u] += fp32 of row addrs[0], then addrs[1], ... (chunks at offs): every load of the
    block is issued before the adds, which keep the rows' order."""
    vals = []
    for a in addrs:
        for o in offs:
            vals.append(vec_tensor(dtype, a + o, VEC).load())
    n = len(offs)
    for u in range(n):
        a = acc[None, u]
        x = a.load()
        for b in range(len(addrs)):
            x = x + vals[b * n + u].to(Float32)
        a.store(x)


def next_lanes(src, mm, nb: int):
    """The next nb lanes of mask mm (lowest first): (their src values, the mask without them)."""
    out = []
    for _ in range(nb):
        out.append(cute.arch.shuffle_sync(src, ctz(mm)))
        mm = mm & (mm - 1)
    return out, mm


def smem_vec(dtype, addr, n: int):
    """n elements of `dtype` (16 bytes) at shared-memory address `addr` (16-byte aligned)."""
    return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=16),
                            cute.make_layout(n))


def acc_store(acc, base, offs, dtype, VEC: int):
    for u in range(len(offs)):
        vec_tensor(dtype, base + offs[u], VEC).store(acc[None, u].load().to(dtype))


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
@cute.kernel
def _presum_kernel(rows: cute.Tensor, row_primary: cute.Tensor, row_next: cute.Tensor,
                   presum: cute.Tensor, status: cute.Tensor, NVS: Constexpr[int], ROWB: Constexpr[int],
                   dtype: Constexpr, NCTA: Constexpr[int], NT: Constexpr[int], U: Constexpr[int],
                   D: Constexpr[int], CM: Constexpr[int]):
    NW = NT // 32
    W = NCTA * NW
    VEC = 16 * 8 // dtype.width
    NC = ROWB // 16
    SEGC = 32 * U                      # chunks per segment (U per lane)
    NSEG = (NC + SEGC - 1) // SEGC
    CLAMP = NC % SEGC != 0             # the last segment is partial: lanes past the end repeat
    SLOT = U * 512                     # bytes of one ring slot of a warp
    _, _, warp, lane, gw = warp_coords(NW)
    smem = cutlass.utils.SmemAllocator()
    ring = smem.allocate_tensor(Int32, cute.make_layout(NW * D * SLOT // 4), byte_alignment=16)
    # this lane's 16 bytes of slot 0, chunk 0 of its warp's ring (slot q, chunk u: + q*SLOT + u*512)
    rbase = Int64(ring.iterator.toint()) + Int64(warp * (D * SLOT) + lane * 16)
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Int32,
                               num_bits_per_copy=128)
    acc = cute.make_rmem_tensor(cute.make_layout((VEC, U)), Float32)
    ra = addr_of(rows)
    pa = addr_of(presum)
    for i0 in cutlass.range(gw * 32, NVS, W * 32):
        i = i0 + lane
        ic = cutlass.min(i, Int32(NVS - 1))
        p = row_primary[ic]
        flag_bad_table(status, (i < NVS) & ((p < -1) | (p >= NVS)))  # -1: a padding row
        hm = cute.arch.vote_ballot_sync((i < NVS) & (p == i))
        # Items (head j, segment, chain row c) in that order. The producer issues item np_ into ring
        # slot np_ % D (one commit group per item) once that slot is free; the consumer adds item nc
        # when D items are in flight (or the producer is done) and stores at each chain's end. A
        # walker follows the next head's chain one step per iteration (its pointer load overlaps
        # the iteration), so the producer finds the chain ready when it finishes a head.
        pm = hm           # producer: heads not finished; its head is the lowest, (pseg, pc) in it
        pready = Int32(0)  # the producer holds its head's chain (pnode, pl)
        pseg = Int32(0)
        pc = Int32(0)
        pl = Int32(0)
        pnode = Int32(0)  # lane c: row c of the producer's chain
        lenreg = Int32(0)  # lane j: chain length of head j (set when the producer takes head j)
        cm = hm           # consumer: heads not finished; its head is the lowest, (cseg, cc) in it
        cseg = Int32(0)
        cc = Int32(0)
        np_ = Int32(0)
        nc = Int32(0)
        wcur = cutlass.select_(hm != 0, i0 + ctz(cutlass.select_(hm != 0, hm, Int32(1))), Int32(-1))
        wc = Int32(0)     # walker: wcur the row to record next (-1: done), wc rows recorded
        wnode = Int32(0)  # lane c: row c of the walker's chain
        acc.fill(0.0)
        while cm != 0:
            wl = wcur
            wnx = row_next[cutlass.max(wcur, Int32(0))]
            # take the walked chain of the next head
            if (pready == 0) & (pm != 0) & (wcur < 0):
                pnode = wnode
                pl = wc
                lenreg = cutlass.select_(lane == ctz(pm), wc, lenreg)
                pready = Int32(1)
                rest = pm & (pm - 1)
                wcur = cutlass.select_(rest != 0, i0 + ctz(cutlass.select_(rest != 0, rest, Int32(1))),
                                       Int32(-1))
                wc = Int32(0)
            # produce
            if (pready != 0) & (np_ - nc < D):
                src = ra + Int64(cute.arch.shuffle_sync(pnode, pc)) * ROWB
                sl = rbase + Int64((np_ % D) * SLOT)
                for u in cutlass.range_constexpr(U):
                    ch = pseg * SEGC + (u * 32) + lane
                    if cutlass.const_expr(CLAMP):
                        ch = cutlass.min(ch, Int32(NC - 1))
                    cute.copy(atom, vec_tensor(Int32, src + Int64(ch) * 16, 4),
                              smem_vec(Int32, sl + u * 512, 4))
                cute.arch.cp_async_commit_group()
                np_ = np_ + 1
                pc = pc + 1
                if pc == pl:
                    pc = Int32(0)
                    pseg = pseg + 1
                    if pseg == NSEG:
                        pseg = Int32(0)
                        pm = pm & (pm - 1)
                        pready = Int32(0)
            # consume
            full = np_ - nc == D
            if full | ((pm == 0) & (np_ > nc)):
                if full:
                    cute.arch.cp_async_wait_group(D - 1)
                else:
                    cute.arch.cp_async_wait_group(0)
                sl = rbase + Int64((nc % D) * SLOT)
                for u in cutlass.range_constexpr(U):
                    a = acc[None, u]
                    a.store(a.load() + smem_vec(dtype, sl + u * 512, VEC).load().to(Float32))
                nc = nc + 1
                cj = ctz(cm)
                cc = cc + 1
                if cc == cute.arch.shuffle_sync(lenreg, cj):
                    dst = pa + Int64(i0 + cj) * ROWB
                    for u in cutlass.range_constexpr(U):
                        ch = cseg * SEGC + (u * 32) + lane
                        if cutlass.const_expr(CLAMP):
                            ch = cutlass.min(ch, Int32(NC - 1))
                        vec_tensor(dtype, dst + Int64(ch) * 16, VEC).store(acc[None, u].load().to(dtype))
                    acc.fill(0.0)
                    cc = Int32(0)
                    cseg = cseg + 1
                    if cseg == NSEG:
                        cseg = Int32(0)
                        cm = cm & (cm - 1)
            # walker step with the pointer loaded above (not if it was just restarted)
            if (wcur >= 0) & (wcur == wl):
                wnode = cutlass.select_(lane == wc, wcur, wnode)
                wc = wc + 1
                more = (wnx >= 0) & (wnx < NVS)
                # (the walker is warp-uniform: lane 0 flags) -1 ends a chain; past CM rows it is a cycle
                flag_bad_table(status, (lane == 0) & ((wnx < -1) | (wnx >= NVS) | (more & (wc >= CM))))
                wcur = cutlass.select_(more & (wc < CM), wnx, Int32(-1))


@cute.jit
def _pull_segment(acc: cute.Tensor, src: Int64, car: Int32, ncar: Int32, dst: Int64, c0: Int32, lane: Int32,
                  U: Constexpr[int], NC: Constexpr[int], clamp: Constexpr[bool], dtype: Constexpr,
                  VEC: Constexpr[int], NB: Constexpr[int]):
    """One segment of a token's output row: the fp32 sum, in k order, of the presummed rows of its
    carriers (lanes of `car`; each lane's `src` is its row's address), NB rows' loads in flight."""
    offs = chunk_offsets(c0, lane, U, NC, clamp)
    acc.fill(0.0)
    mm = car
    for _q in cutlass.range(ncar // NB):
        srcs, mm = next_lanes(src, mm, NB)
        acc_add_rows(acc, srcs, offs, dtype, VEC)
    # the < NB carriers left, in blocks of NB/2, NB/4, ..., 2, then 1 (NB a power of two)
    for i in cutlass.range_constexpr(1, NB.bit_length() - 1):
        if cute.arch.popc(mm) >= (NB >> i):
            srcs, mm = next_lanes(src, mm, NB >> i)
            acc_add_rows(acc, srcs, offs, dtype, VEC)
    if mm != 0:
        srcs, mm = next_lanes(src, mm, 1)
        acc_add_rows(acc, srcs, offs, dtype, VEC)
    acc_store(acc, dst, offs, dtype, VEC)


@cute.kernel
def _pull_kernel(source: cute.Tensor, dst_rank: cute.Tensor, dst_row: cute.Tensor,
                 primary_row: cute.Tensor, out: cute.Tensor, status: cute.Tensor, S: Constexpr[int], K: Constexpr[int],
                 R: Constexpr[int], NVS: Constexpr[int], ROWB: Constexpr[int], dtype: Constexpr,
                 NCTA: Constexpr[int], NT: Constexpr[int], U: Constexpr[int], NB: Constexpr[int],
                 LOCAL: Constexpr[bool]):
    """`source`: every rank's presum address (int64 [R]); LOCAL (one rank): the rows themselves, every
    row of a token a carrier (its chain, in k order: what presum summed)."""
    NW = NT // 32
    W = NCTA * NW
    VEC = 16 * 8 // dtype.width
    NC, nfull, UT, clamp = row_geometry(ROWB, U)
    _, _, warp, lane, gw = warp_coords(NW)
    acc = cute.make_rmem_tensor(cute.make_layout((VEC, U)), Float32)
    oa = addr_of(out)
    kl = cutlass.min(lane, Int32(K - 1))
    for s in cutlass.range(gw, S, W):
        idx = s * K + kl
        d = dst_rank[idx]
        r = dst_row[idx]
        pr = primary_row[idx]
        ok = (lane < K) & (d >= 0) & (d < R) & (r >= 0) & (r < NVS)
        flag_bad_table(status, (lane < K) & (d != -1) & ((ok == False) | (pr < 0) | (pr >= NVS)))  # noqa: E712
        car = cute.arch.vote_ballot_sync(ok if cutlass.const_expr(LOCAL) else ok & (r == pr))
        ncar = cute.arch.popc(car)
        if cutlass.const_expr(LOCAL):
            src = addr_of(source) + Int64(cutlass.select_(ok, r, Int32(0))) * ROWB
        else:
            src = (source[cutlass.select_(ok, d, Int32(0))]
                   + Int64(cutlass.select_(ok, r, Int32(0))) * ROWB)
        dst = oa + Int64(s) * ROWB
        for seg in cutlass.range(nfull):
            _pull_segment(acc, src, car, ncar, dst, seg * (32 * U), lane, U, NC, False, dtype, VEC, NB)
        if cutlass.const_expr(UT > 0):
            _pull_segment(acc, src, car, ncar, dst, Int32(nfull * 32 * U), lane, UT, NC, clamp, dtype, VEC, NB)


@cute.kernel
def _gather_kernel(peer_vals: cute.Tensor, dst_rank: cute.Tensor, dst_row: cute.Tensor,
                   out: cute.Tensor, status: cute.Tensor, N: Constexpr[int], R: Constexpr[int], NVS: Constexpr[int],
                   NCTA: Constexpr[int], NT: Constexpr[int]):
    UG = 4
    T = NCTA * NT
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    t = bx * NT + tidx
    for i0 in cutlass.range(t, N, T * UG):
        vals = []
        bad = cutlass.Boolean(False)  # over the UG entries, flagged after the stores: the loads stay batched
        for u in cutlass.range_constexpr(UG):
            i = cutlass.min(i0 + u * T, Int32(N - 1))
            d = dst_rank[i]
            r = dst_row[i]
            ok = (d >= 0) & (d < R) & (r >= 0) & (r < NVS)
            bad = bad | ((d != -1) & (ok == False))  # noqa: E712
            a = (peer_vals[cutlass.select_(ok, d, Int32(0))]
                 + Int64(cutlass.select_(ok, r, Int32(0))) * 4)
            v = cute.arch.load(cute.make_ptr(Float32, a, cute.AddressSpace.gmem, assumed_align=4),
                               Float32)
            vals.append(cutlass.select_(ok, v, Float32(0.0)))
        for u in cutlass.range_constexpr(UG):
            if i0 + u * T < N:
                out[i0 + u * T] = vals[u]
        flag_bad_table(status, bad)


@cute.jit
def _presum_launch(rows: cute.Tensor, row_primary: cute.Tensor, row_next: cute.Tensor,
                   presum: cute.Tensor, status: cute.Tensor, stream, NVS: Constexpr[int], ROWB: Constexpr[int],
                   dtype: Constexpr, NCTA: Constexpr[int], NT: Constexpr[int], U: Constexpr[int],
                   D: Constexpr[int]):
    _presum_kernel(rows, row_primary, row_next, presum, status, NVS, ROWB, dtype, NCTA, NT, U, D,
                   _CHAIN_MAX).launch(grid=(NCTA, 1, 1), block=(NT, 1, 1), stream=stream)


@cute.jit
def _pull_launch(source: cute.Tensor, dst_rank: cute.Tensor, dst_row: cute.Tensor,
                 primary_row: cute.Tensor, out: cute.Tensor, status: cute.Tensor, stream, S: Constexpr[int],
                 K: Constexpr[int], R: Constexpr[int], NVS: Constexpr[int], ROWB: Constexpr[int],
                 dtype: Constexpr, NCTA: Constexpr[int], LOCAL: Constexpr[bool], NT: Constexpr[int],
                 U: Constexpr[int], NB: Constexpr[int]):
    _pull_kernel(source, dst_rank, dst_row, primary_row, out, status, S, K, R, NVS, ROWB, dtype, NCTA,
                 NT, U, NB, LOCAL).launch(grid=(NCTA, 1, 1), block=(NT, 1, 1), stream=stream)


@cute.jit
def _gather_launch(peer_vals: cute.Tensor, dst_rank: cute.Tensor, dst_row: cute.Tensor,
                   out: cute.Tensor, status: cute.Tensor, stream, N: Constexpr[int], R: Constexpr[int],
                   NVS: Constexpr[int], NCTA: Constexpr[int]):
    _gather_kernel(peer_vals, dst_rank, dst_row, out, status, N, R, NVS, NCTA, _NT_GATHER).launch(
        grid=(NCTA, 1, 1), block=(_NT_GATHER, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# compile cache
# ------------------------------------------------------------------------------------------------
_JIT = KernelFamily("combine", (__name__,))


@compiler
def _compile_presum(NVS: int, H: int, dtype: torch.dtype, ncta: int, nt: int = _NT_PRESUM,
                    u: int = _U_PRESUM, d: int = _D_PRESUM):
    dt = ROW_DTYPES[dtype]

    def build():
        return cute.compile(_presum_launch, fake(dt, NVS * H), fake(Int32, NVS, 4), fake(Int32, NVS, 4),
                            fake(dt, NVS * H), fake(Int32, 1, 4), fake_stream(), NVS, H * dtype.itemsize, dt, ncta, nt,
                            u, d, options="--enable-tvm-ffi")
    return _JIT.compiled(("presum", NVS, H, dtype, ncta, nt, u, d), build)


@compiler
def _compile_pull(S: int, H: int, K: int, R: int, NVS: int, dtype: torch.dtype, ncta: int, local: bool = False,
                  nt: int = _NT_PULL, u: int | None = None, nb: int | None = None):
    """nt threads per CTA, u 16-byte chunks per lane per segment, nb (a power of two) rows read at once
    (defaults: _U_LOCAL and _NB_LOCAL for the one-pass local variant, else _U_PULL and _NB_PULL); the public
    wrappers take the defaults, benchmarks/bench_combine.py sweeps them."""
    dt = ROW_DTYPES[dtype]
    u = (_U_LOCAL if local else _U_PULL) if u is None else u
    nb = (_NB_LOCAL if local else _NB_PULL) if nb is None else nb
    if nt % 32 or not 32 <= nt <= 1024 or u < 1 or nb < 1 or nb & (nb - 1):
        raise ValueError(f"combine pull: nt={nt} must be a multiple of 32 in [32, 1024], u={u} >= 1 and "
                         f"nb={nb} a power of two")

    def build():
        source = fake(dt, NVS * H) if local else fake(Int64, R, 8)
        return cute.compile(_pull_launch, source, fake(Int32, S * K, 4),
                            fake(Int32, S * K, 4), fake(Int32, S * K, 4), fake(dt, S * H), fake(Int32, 1, 4),
                            fake_stream(),
                            S, K, R, NVS, H * dtype.itemsize, dt, ncta, local, nt, u, nb,
                            options="--enable-tvm-ffi")
    return _JIT.compiled(("pull", S, H, K, R, NVS, dtype, ncta, nt, u, nb) + (("local",) if local else ()), build)


@compiler
def _compile_gather(S: int, K: int, R: int, NVS: int, ncta: int):
    def build():
        return cute.compile(_gather_launch, fake(Int64, R, 8), fake(Int32, S * K, 4),
                            fake(Int32, S * K, 4), fake(Float32, S * K, 4), fake(Int32, 1, 4), fake_stream(), S * K, R,
                            NVS, ncta, options="--enable-tvm-ffi")
    return _JIT.compiled(("gather", S, K, R, NVS, ncta), build)


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------
def combine_presum(rows: torch.Tensor, row_primary: torch.Tensor, row_next: torch.Tensor,
                   presum: torch.Tensor, status: torch.Tensor, num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Local: presum[p] = row dtype of the fp32 sum over the chain p, row_next[p], ... of rows[...]
    for every row p with row_primary[p] == p; other rows of presum untouched.
    rows, presum [NvS, H] bf16/fp16/fp32 (same dtype); row_primary, row_next int32 [NvS]; status int32
    [1]: STATUS_BAD_TABLE is OR-ed in for a skipped table entry (module docstring)."""
    need_rows("rows", rows)
    dev = rows.device
    NVS, H = rows.shape
    need_rows("presum", presum, rows.dtype, (NVS, H), dev)
    need_tensor("row_primary", row_primary, (torch.int32,), shape=(NVS,), device=dev)
    need_tensor("row_next", row_next, (torch.int32,), shape=(NVS,), device=dev)
    need_status(status, dev)
    num_ctas = need_int("num_ctas", num_ctas)
    check_fits(1, 1, NVS)
    fn = _compile_presum(NVS, H, rows.dtype, num_ctas)
    fn(rows.view(-1), row_primary, row_next, presum.view(-1), status)


def combine_pull(peer_presum: torch.Tensor, dst_rank: torch.Tensor, dst_row: torch.Tensor,
                 primary_row: torch.Tensor, out: torch.Tensor, status: torch.Tensor,
                 num_ctas: int = DEFAULT_NUM_CTAS, nvs: int | None = None) -> None:
    """out[s] = row dtype of the fp32 sum, in k order, over the k with dst_row[s, k] ==
    primary_row[s, k], of presum[dst_row[s, k]] on rank dst_rank[s, k].
    peer_presum int64 [R]: addresses of every rank's presum [nvs, H] (out's dtype);
    plan tables int32 [S, K]; out [S, H] bf16/fp16/fp32. `nvs` (optional): rows per rank; with it,
    entries with dst_row >= nvs are skipped (without it only negative rows are; the moonep ops pass it).
    status int32 [1]: STATUS_BAD_TABLE is OR-ed in for a skipped table entry (module docstring)."""
    dev, S, H, K = need_rows_and_plan("out", out, dst_rank, dst_row, primary_row)
    R = need_peers("peer_presum", peer_presum, device=dev)
    need_status(status, dev)
    nvs = _NO_NVS if nvs is None else need_int("nvs", nvs)
    num_ctas = need_int("num_ctas", num_ctas)
    check_fits(S, K, nvs)
    fn = _compile_pull(S, H, K, R, nvs, out.dtype, num_ctas)
    fn(peer_presum, dst_rank.view(-1), dst_row.view(-1), primary_row.view(-1), out.view(-1), status)


def combine_local(rows: torch.Tensor, dst_rank: torch.Tensor, dst_row: torch.Tensor, primary_row: torch.Tensor,
                  out: torch.Tensor, status: torch.Tensor, num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """One rank, one pass: out[s] = row dtype of the fp32 sum, in k order, of rows[dst_row[s, k]] over the
    valid entries (dst_rank 0, dst_row in [0, NvS)) -- bitwise what combine_presum + combine_pull give
    with R = 1 (a token's chain is its rows in k order, summed in fp32 and rounded once either way),
    without writing and re-reading the presums. rows [NvS, H] and out [S, H] bf16/fp16/fp32 (one dtype);
    plan tables int32 [S, K]; status as combine_pull's (an entry with a rank other than 0 or -1, or a row
    outside [0, NvS), is skipped and flagged)."""
    dev, S, H, K = need_rows_and_plan("out", out, dst_rank, dst_row, primary_row)
    need_rows("rows", rows, out.dtype, device=dev)
    if rows.shape[1] != H:
        raise ValueError(f"combine_local: rows has {rows.shape[1]} columns, out {H}: they must match")
    need_status(status, dev)
    num_ctas = need_int("num_ctas", num_ctas)
    NVS = rows.shape[0]
    check_fits(S, K, NVS)
    fn = _compile_pull(S, H, K, 1, NVS, out.dtype, num_ctas, local=True)
    fn(rows.view(-1), dst_rank.view(-1), dst_row.view(-1), primary_row.view(-1), out.view(-1), status)


def gather_pull(peer_vals: torch.Tensor, dst_rank: torch.Tensor, dst_row: torch.Tensor,
                out: torch.Tensor, status: torch.Tensor, num_ctas: int = DEFAULT_NUM_CTAS,
                nvs: int | None = None) -> None:
    """out[s, k] = vals[dst_row[s, k]] on rank dst_rank[s, k] (0 outside the plan).
    peer_vals int64 [R]: addresses of every rank's vals f32 [nvs]; plan tables int32 [S, K];
    out f32 [S, K]; status int32 [1] and `nvs` (optional): as in `combine_pull`."""
    S, K = need_plan(dst_rank, dst_row)
    dev = dst_rank.device
    need_tensor("out", out, (torch.float32,), shape=(S, K), device=dev)
    R = need_peers("peer_vals", peer_vals, device=dev)
    need_status(status, dev)
    nvs = _NO_NVS if nvs is None else need_int("nvs", nvs)
    num_ctas = need_int("num_ctas", num_ctas)
    check_fits(S, K, nvs)
    fn = _compile_gather(S, K, R, nvs, num_ctas)
    fn(peer_vals, dst_rank.view(-1), dst_row.view(-1), out.view(-1), status)


# ------------------------------------------------------------------------------------------------
# CI: compile every kernel for sm_90a without a GPU (run in a child by compile_check)
# ------------------------------------------------------------------------------------------------
DEFAULT_CHECK_CONFIGS = [
    dict(S=8192, H=7168, K=8, R=2, NVS=align_up(8192 * 8 + 127 * 96, 128), dtype="bfloat16"),
    dict(S=7, H=64, K=6, R=2, NVS=align_up(7 * 6 + 15 * 6, 16), dtype="bfloat16"),
    dict(S=7, H=72, K=6, R=4, NVS=align_up(7 * 6 + 15 * 6, 16), dtype="float32"),
    dict(S=9, H=200, K=5, R=4, NVS=align_up(9 * 5 + 15 * 6, 16), dtype="float16"),
    # one rank (also the one-pass combine_local): S=8192, H=7168, K=8, E=48, P=128
    dict(S=8192, H=7168, K=8, R=1, NVS=align_up(8192 * 8 + 127 * 48, 128), dtype="bfloat16"),
]


def compile_all_for_check(configs: list[dict] | None = None, num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Compile presum, pull and gather for each config, and at R = 1 also the one-pass pull of
    combine_local; on a machine without a CUDA driver each compile stops at loading (caught: exactly
    DSLRuntimeError from CudaDriverDependencyError)."""
    from csrc_cute.compile_check import compile_and_report

    for cfg in configs or DEFAULT_CHECK_CONFIGS:
        S, H, K, R, NVS = (cfg[k] for k in ("S", "H", "K", "R", "NVS"))
        dt = getattr(torch, cfg.get("dtype", "bfloat16"))
        builds = [("presum", lambda: _compile_presum(NVS, H, dt, num_ctas)),
                  ("pull", lambda: _compile_pull(S, H, K, R, NVS, dt, num_ctas)),
                  ("gather", lambda: _compile_gather(S, K, R, NVS, num_ctas))]
        if R == 1:
            builds.append(("pull_local", lambda: _compile_pull(S, H, K, R, NVS, dt, num_ctas, local=True)))
        for name, build in builds:
            compile_and_report(f"{name} S={S} H={H} K={K} R={R} NvS={NVS} {dt}", build)
