"""Dispatch data movement as CuTe DSL CUDA kernels, pull-based. `dispatch_meta` publishes this
rank's token rows in a local staging buffer (`send_rows`, symmetric: the peers read it) and writes
the row metadata into the destination ranks' buffers; after a cross-rank barrier (run by the
caller) `dispatch_pull` reads every token row this rank receives once (over NVLink when it comes
from a peer) and writes it to all of that token's rows here. No row data crosses the link in
`dispatch_meta`; in `dispatch_pull` each token crosses to each destination rank once.

Semantics (S tokens, K top-k, R ranks, NvS receive rows, G = epn+B groups; plan tables [S, K] int32
`dst_rank`, `dst_row`, `primary_row` as in `moonep_ops/planning.py`):

  dispatch_meta   for every (s, k) with d = dst_rank[s, k], r = dst_row[s, k], on rank d:
                    w[r] = route_w[s, k], primary[r] = primary_row[s, k],
                    next[r] = dst_row[s, k'] of the next k' > k with dst_rank[s, k'] == d, else -1,
                    src[r] = rank * S + s;
                  this rank's own padding rows (past each group's real rows, and past the last
                  group end): w 0, primary -1, next -1, src -1 (local writes);
                  send_rows[s] = x[s] (local copy; at R = 1 nothing is staged: pull reads x).
  dispatch_pull   local writes, remote reads, after the barrier: for every row p with
                  primary[p] == p and a valid src: (r, s) = divmod(src[p], S), and row s of rank r's
                  send_rows (at R = 1: of x) is written to out_rows at p, next[p], next[next[p]], ... (the chain of
                  the token's rows here); rows with primary outside [0, NvS) (padding) get zeros;
                  out_w / out_primary / out_next = copies of w / primary / next.
                  Together: the outputs equal the old push + finish outputs bit for bit.

Peer arguments are int64 [R] tensors holding the device address of the same (16-byte aligned) buffer
on every rank. Rows move as 16-byte vectors (any row dtype with H * itemsize a multiple of 16).
Entries with a destination rank outside [0, R) or a row outside [0, NvS) are skipped: dst_rank = -1
is the legal mark of an absent token (never sent, nothing written); chains are followed for at most 32
rows and stop at a row outside [0, NvS); a head row whose src is outside [0, R*S) is zeroed (its chain
is not followed). Every skipped entry other than the absent-token marker ORs STATUS_BAD_TABLE into
`status` (the EP group's status word, int32 [1]; no host sync):
  meta    an entry (s, k) with dst_rank not -1 and outside [0, R), or a valid rank with dst_row or
          primary_row outside [0, NvS); a group g with cu_seqlens decreasing or past NvS, or
          group_rows[g] outside [0, the group's length] (checked by the grid's first warp).
  pull    a row whose recv_primary or recv_next is outside [-1, NvS), a row with a primary in
          [0, NvS) whose recv_src is outside [0, R*S), a chain longer than 32 rows (a cycle).
The checks compare values the kernels load anyway; one atomic per offending entry.

Kernels (sm_90a, persistent grids of `num_ctas` CTAs, apache-tvm-ffi fast path, compiled once per
static key):
  meta    one warp per token (grid-stride): lanes < K hold the token's k entries; match.any on the
          destination rank finds each entry's next row (the lowest higher lane with the same rank);
          scalar stores of w / primary / next / src to the destination rank. Then the threads stride
          over this rank's padding rows (the padding ranges of 32 groups at a time, found by a
          ballot), then copy x to send_rows (U 16-byte chunks per thread in flight, grid-stride),
          except at R = 1: the only reader is this rank's pull, which reads x itself (0.23 GB less
          HBM traffic per dispatch at S=8192, H=7168).
  pull    one warp per 32 rows (grid-stride): the lanes copy the rows' metadata (coalesced), a
          ballot finds the padding rows (zero stores only) and the chain heads; the lanes walk the
          heads' chains in lockstep into a per-warp node table in shared memory (32 x 32 int32),
          then per head and segment of U chunks per lane the source row is loaded once (32 * U * 16
          bytes in flight per warp) and stored to every row of its chain. At R = 1 the rows move by
          bulk copies (csrc_cute/bulk.py) instead, issued by each warp's lane 0: a row in pieces of
          _BULK_PIECE bytes, each loaded once into one of the warp's _BULK_SLOTS shared-memory slots
          (the next pieces load while one is stored) and stored to every row of its chain; padding
          rows get a zero piece. The vector form spent 43% of its stalls on a full load/store queue
          at 55% of HBM bandwidth (ncu, H200); one bulk store replaces 256 vector stores per 4 KiB.
          Measured: 428 -> 416 us at the DESIGN shape with 264 CTAs (benchmarks/results/
          dispatch_ctas_h200.txt): the queue was not the main limit.

Host wrappers: `dispatch_meta`, `dispatch_pull`; `compile_all_for_check` for CI (see compile_check).
"""

# (no `from __future__ import annotations`: the DSL reads Constexpr annotations at runtime)

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Float32, Int32, Int64

from moonep_ops.checks import need_int, need_peers, need_placement, need_rank, need_status, need_tensor

from .bulk import bulk_load, bulk_store, commit_stores, wait_stores_done, wait_stores_read
from .jit import KernelFamily, compiler
from .status import DEFAULT_COMM_SMS as DEFAULT_NUM_CTAS
from .status import STATUS_BAD_TABLE
from .warp import ctz, lanemask_lt, match_any, ptr

_NT = 512          # threads per CTA (16 warps), both kernels
_U_META = 8        # 16-byte chunks per thread in flight in meta's x copy
_U_PULL = 16       # 16-byte chunks per lane per segment in pull (8 KiB per warp in flight)
_CM = 32           # longest chain followed (a token has at most K <= 32 rows on a rank)
# R = 1 pull by bulk copies (csrc_cute/bulk.py): one lane per warp loads a piece of a token row into a
# shared-memory slot and stores it to each of the token's rows; the warp's other lanes only do the tables
_NT_BULK = 256     # threads per CTA
_BULK_SLOTS = 4    # pieces in flight per warp (shared-memory slots; 3 loading while one is stored)
_BULK_PIECE = 4096  # bytes per bulk copy (a row moves in pieces of at most this)
_U = 8             # default chunks per lane per segment of the shared row helpers

ROW_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: Float32}


# ------------------------------------------------------------------------------------------------
# device helpers (straight-line code: no dynamic control flow, so no AST rewriting is needed)
# ------------------------------------------------------------------------------------------------
def row_geometry(rowb: int, U: int = _U):
    """A row of `rowb` bytes as NC 16-byte chunks: `nfull` full segments of 32*U chunks, then a tail
    of UT chunks per lane; `clamp`: the tail's last step is partial (lanes past the end repeat the
    last chunk, which is harmless: they load and store the same bytes)."""
    NC = rowb // 16
    seg = 32 * U
    nfull = NC // seg
    rem = NC - nfull * seg
    UT = (rem + 31) // 32
    return NC, nfull, UT, rem % 32 != 0


def lanemask_gt(lane):
    """Mask of the lanes above `lane`."""
    return Int32(-1) ^ (lanemask_lt() | (Int32(1) << lane))


def chunk_offsets(c0, lane, U: int, NC: int, clamp: bool):
    """Byte offsets (Int64) of this lane's U chunks of the segment starting at chunk c0."""
    if not clamp:  # one 64-bit base; the constant steps fold into the load/store offsets
        base = Int64(c0 + lane) * 16
        return [base + u * 512 for u in range(U)]
    offs = []
    for u in range(U):
        c = cutlass.min(c0 + u * 32 + lane, Int32(NC - 1))
        offs.append(Int64(c) * 16)
    return offs


def vec_tensor(dtype, addr, n: int):
    """n elements of `dtype` (one vector access, at most 16 bytes) at global address `addr`, aligned to
    the vector's size."""
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=n * dtype.width // 8)
    return cute.make_tensor(ptr, cute.make_layout(n))


def load_chunks(base, offs):
    vals = []
    for o in offs:
        vals.append(vec_tensor(Int32, base + o, 4).load())
    return vals


def store_chunks(base, offs, vals):
    for o, v in zip(offs, vals):
        vec_tensor(Int32, base + o, 4).store(v)


def copy_segment(src, dst, c0, lane, U: int, NC: int, clamp: bool):
    offs = chunk_offsets(c0, lane, U, NC, clamp)
    store_chunks(dst, offs, load_chunks(src, offs))


def zero_segment(dst, c0, lane, U: int, NC: int, clamp: bool):
    offs = chunk_offsets(c0, lane, U, NC, clamp)
    z = cute.full((4,), 0, Int32)
    for o in offs:
        vec_tensor(Int32, dst + o, 4).store(z)


def store_scalar(dtype, addr, val, align: int = 4):
    cute.arch.store(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align), val)


def addr_of(t: cute.Tensor):
    return t.iterator.toint()


@cute.jit
def flag_bad_table(status: cute.Tensor, bad):
    """OR STATUS_BAD_TABLE into the status word where `bad` (this thread skipped a table entry that is
    out of range and not a legal marker)."""
    if bad:
        cute.arch.atomic_or(ptr(status, 0), Int32(STATUS_BAD_TABLE))


def warp_coords(NW: int):
    """(thread, CTA, warp in the CTA, lane, warp index in the grid) of a kernel with NW warps per CTA."""
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    return tidx, bx, warp, lane, bx * NW + warp


def bulk_pieces(rowb: int) -> int:
    """Bulk copies per row of `rowb` bytes: pieces of _BULK_PIECE bytes, the last one shorter."""
    return (rowb + _BULK_PIECE - 1) // _BULK_PIECE


def vec_smem(t: cute.Tensor, i):
    """Four Int32 of shared tensor t from element i (16-byte aligned)."""
    return cute.make_tensor(t.iterator + i, cute.make_layout(4))


@cute.jit
def _bulk_init(zeros: cute.Tensor, mbars: cute.Tensor, warp, lane, tidx, NT: Constexpr[int],
               SLOTS: Constexpr[int]):
    """Zero the CTA's zero piece (the padding rows' source) and arm each warp's slot mbarriers; the
    zeros are made visible to the copy engine (async proxy) before any warp stores them."""
    for i in cutlass.range(tidx, cute.size(zeros) // 4, NT):
        vec_smem(zeros, i * 4).store(cute.full((4,), 0, Int32))
    if lane == 0:
        for s in cutlass.range_constexpr(SLOTS):
            cute.arch.mbarrier_init(mbars.iterator + warp * SLOTS + s, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_threads()


@cute.jit
def _bulk_zero_rows(pm, i0, oa, zeros: cute.Tensor, ROWB: Constexpr[int]):
    """Lane 0: the padding rows of the batch at i0 (mask pm) get zeros, one bulk store per piece."""
    za = zeros.iterator.toint()
    for _j in cutlass.range(cute.arch.popc(pm)):
        lj = ctz(pm)
        pm = pm & (pm - 1)
        dst = oa + Int64(i0 + lj) * ROWB
        for p in cutlass.range_constexpr(bulk_pieces(ROWB)):
            bulk_store(dst + p * _BULK_PIECE, za, min(_BULK_PIECE, ROWB - p * _BULK_PIECE))
    commit_stores()


@cute.jit
def _bulk_load_piece(u, used, heads, srcs, slots: cute.Tensor, mbars: cute.Tensor, warp,
                     ROWB: Constexpr[int], SLOTS: Constexpr[int], PIECE: Constexpr[int]):
    """Lane 0: piece u of the batch (head u // pieces, piece u % pieces) into its slot."""
    npc = bulk_pieces(ROWB)
    h = u // npc
    off = (u - h * npc) * PIECE
    n = cutlass.min(Int32(PIECE), Int32(ROWB) - off)
    slot = warp * SLOTS + (used + u) % SLOTS
    mbar = mbars.iterator + slot
    cute.arch.mbarrier_arrive_and_expect_tx(mbar, n)
    bulk_load(slots.iterator.toint() + slot * PIECE, srcs[warp * 32 + heads[warp * 64 + h]] + Int64(off), n,
              mbar.toint())


@cute.jit
def _bulk_copy_chains(nh, used, oa, nodes: cute.Tensor, heads, srcs, slots: cute.Tensor, mbars: cute.Tensor,
                      warp, nb, ROWB: Constexpr[int], SLOTS: Constexpr[int], PIECE: Constexpr[int]):
    """Lane 0: the batch's nh chain heads, piece by piece: SLOTS - 1 pieces load while one is stored to
    every row of its chain (heads [64] per warp: the head lanes in order, then each lane's chain
    length; srcs: each lane's source row address; `used`: pieces the warp moved before this batch,
    which fixes each slot's mbarrier phase)."""
    npc = bulk_pieces(ROWB)
    n = nh * npc
    wait_stores_read(0)  # the previous batch's stores have read every slot
    for u in cutlass.range(cutlass.min(n, Int32(SLOTS - 1))):
        _bulk_load_piece(u, used, heads, srcs, slots, mbars, warp, ROWB, SLOTS, PIECE)
    for u in cutlass.range(n):
        if u + (SLOTS - 1) < n:
            wait_stores_read(0)  # piece u - 1's stores have read the slot piece u + SLOTS - 1 takes
            _bulk_load_piece(u + (SLOTS - 1), used, heads, srcs, slots, mbars, warp, ROWB, SLOTS, PIECE)
        slot = warp * SLOTS + (used + u) % SLOTS
        cute.arch.mbarrier_wait(mbars.iterator + slot, ((used + u) // SLOTS) % 2)
        h = u // npc
        off = (u - h * npc) * PIECE
        nbytes = cutlass.min(Int32(PIECE), Int32(ROWB) - off)
        lj = heads[warp * 64 + h]
        sa = slots.iterator.toint() + slot * PIECE
        for j in cutlass.range(heads[warp * 64 + 32 + lj]):
            bulk_store(oa + Int64(nodes[nb + j * 32 + lj]) * ROWB + Int64(off), sa, nbytes)
        commit_stores()


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
@cute.kernel
def _meta_kernel(x: cute.Tensor, route_w: cute.Tensor, dst_rank: cute.Tensor, dst_row: cute.Tensor,
                 primary_row: cute.Tensor, peer_w: cute.Tensor, peer_primary: cute.Tensor,
                 peer_next: cute.Tensor, peer_src: cute.Tensor, recv_w: cute.Tensor,
                 recv_primary: cute.Tensor, recv_next: cute.Tensor, recv_src: cute.Tensor,
                 send_rows: cute.Tensor, cu: cute.Tensor, grows: cute.Tensor, status: cute.Tensor,
                 rank: Int32, S: Constexpr[int], K: Constexpr[int], R: Constexpr[int], NVS: Constexpr[int],
                 G: Constexpr[int], ROWB: Constexpr[int], NCTA: Constexpr[int], NT: Constexpr[int],
                 U: Constexpr[int]):
    NW = NT // 32
    W = NCTA * NW
    T = W * 32
    NCH = S * ROWB // 16
    tidx, bx, warp, lane, gw = warp_coords(NW)
    gt = lanemask_gt(lane)
    l_w = addr_of(recv_w)
    l_pr = addr_of(recv_primary)
    l_nx = addr_of(recv_next)
    l_src = addr_of(recv_src)
    kl = cutlass.min(lane, Int32(K - 1))
    src0 = rank * S

    # 1. tokens: one warp per token
    for s in cutlass.range(gw, S, W):
        idx = s * K + kl
        d = dst_rank[idx]
        r = dst_row[idx]
        pr = primary_row[idx]
        w = route_w[idx]
        ok = (lane < K) & (d >= 0) & (d < R) & (r >= 0) & (r < NVS)
        # -1 marks an absent token; any other rank, or a row of a valid rank, outside the plan is bad
        flag_bad_table(status, (lane < K) & (d != -1) & ((ok == False) | (pr < 0) | (pr >= NVS)))  # noqa: E712
        m = match_any(cutlass.select_(ok, d, Int32(-1) - lane))
        later = m & gt
        nr = cute.arch.shuffle_sync(r, ctz(cutlass.select_(later != 0, later, Int32(1))))
        nxt = cutlass.select_(later != 0, nr, Int32(-1))
        if ok:
            here = d == rank
            r64 = Int64(r) * 4
            store_scalar(Float32, cutlass.select_(here, l_w, peer_w[d]) + r64, w)
            store_scalar(Int32, cutlass.select_(here, l_pr, peer_primary[d]) + r64, pr)
            store_scalar(Int32, cutlass.select_(here, l_nx, peer_next[d]) + r64, nxt)
            store_scalar(Int32, cutlass.select_(here, l_src, peer_src[d]) + r64, src0 + s)

    # 2. this rank's padding rows: group g's rows [start_g + group_rows[g], cu[g]) and, as pseudo
    # group G, [cu[G-1], NvS); row i goes to the thread gw * 32 + lane == i mod T
    t = gw * 32 + lane
    last_end = cu[G - 1]
    for g0 in cutlass.range(0, G + 1, 32):
        g = g0 + lane
        gc = cutlass.min(g, Int32(G - 1))
        end = cu[gc]
        start = cutlass.select_(gc > 0, cu[cutlass.max(gc - 1, Int32(0))], Int32(0))
        gr = grows[gc]
        nreal = cutlass.min(cutlass.max(gr, Int32(0)), cutlass.max(end - start, Int32(0)))
        flag_bad_table(status, (gw == 0) & (g < G) & ((end < start) | (end > NVS) | (gr < 0) | (gr > end - start)))
        a = cutlass.select_(g == G, last_end, start + nreal)
        b = cutlass.select_(g == G, Int32(NVS), end)
        a = cutlass.max(a, Int32(0))
        b = cutlass.min(b, Int32(NVS))
        pm = cute.arch.vote_ballot_sync((g <= G) & (b > a))
        for _j in cutlass.range(cute.arch.popc(pm)):
            lj = ctz(pm)
            pm = pm & (pm - 1)
            al = cute.arch.shuffle_sync(a, lj)
            bl = cute.arch.shuffle_sync(b, lj)
            off = t - al % T
            off = cutlass.select_(off < 0, off + T, off)
            for i in cutlass.range(al + off, bl, T):
                recv_w[i] = Float32(0.0)
                recv_primary[i] = Int32(-1)
                recv_next[i] = Int32(-1)
                recv_src[i] = Int32(-1)

    # 3. x -> send_rows, U chunks per thread in flight (the last step's excess chunks repeat the
    # last chunk: the same bytes loaded and stored again); at R = 1 pull reads x instead
    if cutlass.const_expr(R > 1):
        th = bx * NT + tidx
        TT = NCTA * NT
        xa = addr_of(x)
        sa = addr_of(send_rows)
        for c0 in cutlass.range(th, NCH, TT * U):
            offs = [Int64(cutlass.min(c0 + u * TT, Int32(NCH - 1))) * 16 for u in range(U)]
            store_chunks(sa, offs, load_chunks(xa, offs))


@cute.kernel
def _pull_kernel(peer_send: cute.Tensor, recv_w: cute.Tensor, recv_primary: cute.Tensor,
                 recv_next: cute.Tensor, recv_src: cute.Tensor, out_rows: cute.Tensor,
                 out_w: cute.Tensor, out_primary: cute.Tensor, out_next: cute.Tensor, status: cute.Tensor,
                 S: Constexpr[int], R: Constexpr[int], NVS: Constexpr[int], ROWB: Constexpr[int],
                 NCTA: Constexpr[int], NT: Constexpr[int], U: Constexpr[int], CM: Constexpr[int]):
    NW = NT // 32
    W = NCTA * NW
    NC, nfull, UT, clamp = row_geometry(ROWB, U)
    tidx, _, warp, lane, gw = warp_coords(NW)
    smem = cutlass.utils.SmemAllocator()
    nodes = smem.allocate_tensor(Int32, cute.make_layout(NW * CM * 32), byte_alignment=16)
    nb = warp * (CM * 32)
    oa = addr_of(out_rows)
    if cutlass.const_expr(R == 1):  # bulk copies (module docstring)
        heads = smem.allocate_tensor(Int32, cute.make_layout(NW * 64), byte_alignment=16)
        srcs = smem.allocate_tensor(Int64, cute.make_layout(NW * 32), byte_alignment=16)
        mbars = smem.allocate_tensor(Int64, cute.make_layout(NW * _BULK_SLOTS), byte_alignment=8)
        slots = smem.allocate_tensor(Int32, cute.make_layout(NW * _BULK_SLOTS * _BULK_PIECE // 4),
                                     byte_alignment=128)
        zeros = smem.allocate_tensor(Int32, cute.make_layout(_BULK_PIECE // 4), byte_alignment=128)
        _bulk_init(zeros, mbars, warp, lane, tidx, NT, _BULK_SLOTS)
        used = Int32(0)
    for i0 in cutlass.range(gw * 32, NVS, W * 32):
        i = i0 + lane
        inb = i < NVS
        ic = cutlass.min(i, Int32(NVS - 1))
        p = recv_primary[ic]
        w = recv_w[ic]
        n = recv_next[ic]
        sv = recv_src[ic]
        if inb:
            out_w[i] = w
            out_primary[i] = p
            out_next[i] = n
        srcok = (sv >= 0) & (sv < R * S)
        # -1 marks a padding row (primary, next) or a chain's end (next); a routed row has a source
        flag_bad_table(status, inb & ((p < -1) | (p >= NVS) | (n < -1) | (n >= NVS)
                                      | ((p >= 0) & (srcok == False))))  # noqa: E712
        svc = cutlass.select_(srcok, sv, Int32(0))
        if cutlass.const_expr(R == 1):
            srca = addr_of(peer_send) + Int64(svc) * ROWB  # R = 1: `peer_send` is x itself
        else:
            rr = svc // S
            srca = peer_send[rr] + Int64(svc - rr * S) * ROWB
        pad = inb & ((p < 0) | (p >= NVS) | ((p == i) & ((sv < 0) | (sv >= R * S))))
        # padding rows: zeros (stores only)
        pm = cute.arch.vote_ballot_sync(pad)
        if cutlass.const_expr(R == 1):
            if lane == 0:
                _bulk_zero_rows(pm, i0, oa, zeros, ROWB)
        else:
            for _j in cutlass.range(cute.arch.popc(pm)):
                lj = ctz(pm)
                pm = pm & (pm - 1)
                dst = oa + Int64(i0 + lj) * ROWB
                for seg in cutlass.range(nfull):
                    zero_segment(dst, seg * (32 * U), lane, U, NC, False)
                if cutlass.const_expr(UT > 0):
                    zero_segment(dst, Int32(nfull * 32 * U), lane, UT, NC, clamp)
        # chain heads: walk all chains of this batch in lockstep (lane j: head j's chain; its row c
        # goes to the warp's node table at c*32 + j), then one head at a time: per segment the
        # source row's U chunks per lane are loaded once and stored to every row of the chain
        head = inb & (p == i) & srcok
        hm = cute.arch.vote_ballot_sync(head)
        cur = cutlass.select_(head, i, Int32(-1))
        ln = Int32(0)
        c = Int32(0)
        act = hm
        while act != 0:
            if cur >= 0:
                nodes[nb + c * 32 + lane] = cur
                ln = c + 1
                nx = recv_next[cur]
                more = (nx >= 0) & (nx < NVS)
                flag_bad_table(status, more & (c + 1 >= CM))  # a chain longer than any token's: a cycle
                cur = cutlass.select_(more & (c + 1 < CM), nx, Int32(-1))
            c = c + 1
            act = cute.arch.vote_ballot_sync(cur >= 0)
        if cutlass.const_expr(R == 1):
            if head:
                heads[warp * 64 + cute.arch.popc(hm & lanemask_lt())] = lane
            heads[warp * 64 + 32 + lane] = ln
            srcs[warp * 32 + lane] = srca
            cute.arch.sync_warp()
            if lane == 0:
                _bulk_copy_chains(cute.arch.popc(hm), used, oa, nodes, heads, srcs, slots, mbars, warp, nb,
                                  ROWB, _BULK_SLOTS, _BULK_PIECE)
            used = used + cute.arch.popc(hm) * bulk_pieces(ROWB)
            cute.arch.sync_warp()  # lane 0 has read the tables before the next batch rewrites them
        else:
            cute.arch.sync_warp()
            for _j in cutlass.range(cute.arch.popc(hm)):
                lj = ctz(hm)
                hm = hm & (hm - 1)
                lenj = cute.arch.shuffle_sync(ln, lj)
                sa = cute.arch.shuffle_sync(srca, lj)
                for seg in cutlass.range(nfull):
                    offs = chunk_offsets(seg * (32 * U), lane, U, NC, False)
                    v = load_chunks(sa, offs)
                    for j in cutlass.range(lenj):
                        store_chunks(oa + Int64(nodes[nb + j * 32 + lj]) * ROWB, offs, v)
                if cutlass.const_expr(UT > 0):
                    offs = chunk_offsets(Int32(nfull * 32 * U), lane, UT, NC, clamp)
                    v = load_chunks(sa, offs)
                    for j in cutlass.range(lenj):
                        store_chunks(oa + Int64(nodes[nb + j * 32 + lj]) * ROWB, offs, v)
            cute.arch.sync_warp()
    if cutlass.const_expr(R == 1):
        if lane == 0:
            wait_stores_done()  # every row written (and the slots read) before the CTA's memory goes


@cute.jit
def _meta_launch(x: cute.Tensor, route_w: cute.Tensor, dst_rank: cute.Tensor, dst_row: cute.Tensor,
                 primary_row: cute.Tensor, peer_w: cute.Tensor, peer_primary: cute.Tensor,
                 peer_next: cute.Tensor, peer_src: cute.Tensor, recv_w: cute.Tensor,
                 recv_primary: cute.Tensor, recv_next: cute.Tensor, recv_src: cute.Tensor,
                 send_rows: cute.Tensor, cu: cute.Tensor, grows: cute.Tensor, status: cute.Tensor,
                 rank: Int32, stream, S: Constexpr[int], K: Constexpr[int], R: Constexpr[int], NVS: Constexpr[int],
                 G: Constexpr[int], ROWB: Constexpr[int], NCTA: Constexpr[int], NT: Constexpr[int],
                 U: Constexpr[int]):
    _meta_kernel(x, route_w, dst_rank, dst_row, primary_row, peer_w, peer_primary, peer_next,
                 peer_src, recv_w, recv_primary, recv_next, recv_src, send_rows, cu, grows, status, rank,
                 S, K, R, NVS, G, ROWB, NCTA, NT, U).launch(
        grid=(NCTA, 1, 1), block=(NT, 1, 1), stream=stream)


@cute.jit
def _pull_launch(peer_send: cute.Tensor, recv_w: cute.Tensor, recv_primary: cute.Tensor,
                 recv_next: cute.Tensor, recv_src: cute.Tensor, out_rows: cute.Tensor,
                 out_w: cute.Tensor, out_primary: cute.Tensor, out_next: cute.Tensor, status: cute.Tensor,
                 stream, S: Constexpr[int], R: Constexpr[int], NVS: Constexpr[int], ROWB: Constexpr[int],
                 NCTA: Constexpr[int], NT: Constexpr[int], U: Constexpr[int]):
    _pull_kernel(peer_send, recv_w, recv_primary, recv_next, recv_src, out_rows, out_w, out_primary,
                 out_next, status, S, R, NVS, ROWB, NCTA, NT, U, _CM).launch(
        grid=(NCTA, 1, 1), block=(NT, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# compile cache (keyed by everything static) and fake arguments
# ------------------------------------------------------------------------------------------------
_JIT = KernelFamily("dispatch", (__name__,))


def fake(dtype, n: int, align: int = 16):
    return cute.runtime.make_fake_compact_tensor(dtype, (n,), assumed_align=align)


def fake_stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


@compiler
def _compile_meta(S: int, H: int, K: int, R: int, NVS: int, G: int, dtype: torch.dtype, ncta: int,
                  nt: int = _NT, u: int = _U_META):
    dt = ROW_DTYPES[dtype]
    rowb = H * dtype.itemsize

    def build():
        return cute.compile(
            _meta_launch, fake(dt, S * H), fake(Float32, S * K, 4), fake(Int32, S * K, 4),
            fake(Int32, S * K, 4), fake(Int32, S * K, 4), fake(Int64, R, 8), fake(Int64, R, 8),
            fake(Int64, R, 8), fake(Int64, R, 8), fake(Float32, NVS, 4), fake(Int32, NVS, 4),
            fake(Int32, NVS, 4), fake(Int32, NVS, 4), fake(dt, S * H), fake(Int32, G, 4),
            fake(Int32, G, 4), fake(Int32, 1, 4), Int32(0), fake_stream(), S, K, R, NVS, G, rowb, ncta, nt, u,
            options="--enable-tvm-ffi")
    return _JIT.compiled(("meta", S, H, K, R, NVS, G, dtype, ncta, nt, u), build)


@compiler
def _compile_pull(S: int, H: int, R: int, NVS: int, dtype: torch.dtype, ncta: int, nt: int | None = None,
                  u: int = _U_PULL):
    dt = ROW_DTYPES[dtype]
    rowb = H * dtype.itemsize
    nt = nt or (_NT_BULK if R == 1 else _NT)

    def build():
        source = fake(dt, S * H) if R == 1 else fake(Int64, R, 8)  # x itself, or the peers' send_rows
        return cute.compile(
            _pull_launch, source, fake(Float32, NVS, 4), fake(Int32, NVS, 4),
            fake(Int32, NVS, 4), fake(Int32, NVS, 4), fake(dt, NVS * H), fake(Float32, NVS, 4),
            fake(Int32, NVS, 4), fake(Int32, NVS, 4), fake(Int32, 1, 4), fake_stream(), S, R, NVS, rowb, ncta,
            nt, u, options="--enable-tvm-ffi")
    return _JIT.compiled(("pull", S, H, R, NVS, dtype, ncta, nt, u), build)


# ------------------------------------------------------------------------------------------------
# host-side validation (no device reads, no syncs)
# ------------------------------------------------------------------------------------------------
def need_rows(name: str, t, dtype=None, shape=None, device=None) -> torch.Tensor:
    """A [n, H] row tensor: bf16/fp16/fp32, rows a multiple of 16 bytes, 16-byte aligned."""
    need_tensor(name, t, tuple(ROW_DTYPES) if dtype is None else (dtype,), shape=shape, ndim=2,
                placement=False)
    if t.shape[1] < 1 or (t.shape[1] * t.element_size()) % 16 != 0:
        raise ValueError(f"{name}: a row must be a positive multiple of 16 bytes (H * itemsize), got "
                         f"H={t.shape[1]} of {t.dtype}")
    if t.shape[0] < 1:
        raise ValueError(f"{name} must have at least one row, got shape {tuple(t.shape)}")
    need_placement(name, t, device)
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must be 16-byte aligned")
    return t


def need_plan(dst_rank, dst_row, primary_row=None, device=None):
    """dst_rank / dst_row (/ primary_row) int32 [S, K] with K <= 32 -> (S, K)."""
    need_tensor("dst_rank", dst_rank, (torch.int32,), ndim=2, device=device)
    S, K = dst_rank.shape
    if S < 1 or K < 1:
        raise ValueError(f"dst_rank must be [S, K] with S, K >= 1, got {tuple(dst_rank.shape)}")
    if K > 32:
        raise ValueError(f"K must be <= 32 (one token's entries fit a warp), got K={K}")
    need_tensor("dst_row", dst_row, (torch.int32,), shape=(S, K), device=device)
    if primary_row is not None:
        need_tensor("primary_row", primary_row, (torch.int32,), shape=(S, K), device=device)
    return S, K


def need_rows_and_plan(name, rows, dst_rank, dst_row, primary_row):
    """Token rows ``rows`` [S, H] and the plan tables [S, K] on its device -> (device, S, H, K)."""
    need_rows(name, rows)
    dev = rows.device
    S, H = rows.shape
    S2, K = need_plan(dst_rank, dst_row, primary_row, dev)
    if S2 != S:
        raise ValueError(f"dst_rank must be [S, K] with S={S} ({name}'s rows), got {tuple(dst_rank.shape)}")
    return dev, S, H, K


def check_fits(S: int, K: int, NVS: int, R: int = 1, rowb: int = 16):
    """Indices the kernels keep in int32: S*K entries, NvS rows, R*S source ids, S*rowb/16 chunks."""
    if (S * K >= 2 ** 31 - 1 or NVS >= 2 ** 31 - 32 or R * S >= 2 ** 31 - 1
            or S * rowb // 16 >= 2 ** 30):
        raise ValueError(f"S*K={S * K}, NvS={NVS}, R*S={R * S} and S*H*itemsize/16={S * rowb // 16} "
                         "must fit int32")


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------
def dispatch_meta(x: torch.Tensor, route_w: torch.Tensor, dst_rank: torch.Tensor,
                  dst_row: torch.Tensor, primary_row: torch.Tensor, peer_w: torch.Tensor,
                  peer_primary: torch.Tensor, peer_next: torch.Tensor, peer_src: torch.Tensor,
                  recv_w: torch.Tensor, recv_primary: torch.Tensor, recv_next: torch.Tensor,
                  recv_src: torch.Tensor, send_rows: torch.Tensor | None, cu_seqlens: torch.Tensor,
                  group_rows: torch.Tensor, rank: int, status: torch.Tensor,
                  num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Write this rank's row metadata into every destination rank's buffers, reset this rank's own
    padding rows' metadata and copy x into this rank's staging buffer `send_rows` (see the module
    docstring). Returns nothing; launches on torch's current stream; the caller runs a cross-rank
    barrier before `dispatch_pull`.

    x [S, H] bf16/fp16/fp32; route_w [S, K] f32; dst_rank, dst_row, primary_row [S, K] int32;
    peer_w / peer_primary / peer_next / peer_src int64 [R]: addresses of every rank's recv_w [NvS]
    f32 / recv_primary / recv_next / recv_src [NvS] int32; recv_* this rank's buffers; send_rows
    [S, H] (x's dtype, this rank's symmetric staging buffer), or None at R = 1 (nothing is staged: the
    kernel's staging argument is then x, which it does not touch); cu_seqlens, group_rows int32 [G] (this
    rank's padded group ends and real rows per group); status int32 [1]: STATUS_BAD_TABLE is OR-ed in
    for a skipped table entry (module docstring)."""
    dev, S, H, K = need_rows_and_plan("x", x, dst_rank, dst_row, primary_row)
    need_tensor("route_w", route_w, (torch.float32,), shape=(S, K), device=dev)
    R = need_peers("peer_w", peer_w, device=dev)
    for n, t in (("peer_primary", peer_primary), ("peer_next", peer_next), ("peer_src", peer_src)):
        need_peers(n, t, R, dev)
    need_tensor("recv_w", recv_w, (torch.float32,), ndim=1, device=dev)
    NVS = recv_w.shape[0]
    if NVS < 1:
        raise ValueError("recv_w must hold at least one row")
    for n, t in (("recv_primary", recv_primary), ("recv_next", recv_next), ("recv_src", recv_src)):
        need_tensor(n, t, (torch.int32,), shape=(NVS,), device=dev)
    if send_rows is None and R > 1:
        raise ValueError(f"send_rows is required with R = {R} > 1 (the peers read this rank's tokens from it); "
                         f"only R = 1 stages nothing")
    staged = x if send_rows is None else need_rows("send_rows", send_rows, x.dtype, (S, H), dev)
    need_tensor("cu_seqlens", cu_seqlens, (torch.int32,), ndim=1, device=dev)
    G = cu_seqlens.numel()
    if G < 1:
        raise ValueError("cu_seqlens must hold at least one group end")
    need_tensor("group_rows", group_rows, (torch.int32,), shape=(G,), device=dev)
    rank = need_rank(rank, R)
    need_status(status, dev)
    num_ctas = need_int("num_ctas", num_ctas)
    check_fits(S, K, NVS, R, H * x.element_size())
    fn = _compile_meta(S, H, K, R, NVS, G, x.dtype, num_ctas)
    fn(x.view(-1), route_w.view(-1), dst_rank.view(-1), dst_row.view(-1), primary_row.view(-1),
       peer_w, peer_primary, peer_next, peer_src, recv_w, recv_primary, recv_next, recv_src,
       staged.view(-1), cu_seqlens, group_rows, status, rank)


def dispatch_pull(peer_send_rows: torch.Tensor | None, recv_w: torch.Tensor, recv_primary: torch.Tensor,
                  recv_next: torch.Tensor, recv_src: torch.Tensor, out_rows: torch.Tensor,
                  out_w: torch.Tensor, out_primary: torch.Tensor, out_next: torch.Tensor, S: int,
                  status: torch.Tensor, num_ctas: int = DEFAULT_NUM_CTAS, x: torch.Tensor | None = None) -> None:
    """After the barrier: every token row this rank receives is read once from its source rank's
    send_rows and written to all of the token's rows here; padding rows get zeros; out_w /
    out_primary / out_next = copies of recv_w / recv_primary / recv_next (see the module docstring).

    peer_send_rows int64 [R]: addresses of every rank's send_rows [S, H] (out_rows' dtype), or None for
    R = 1; at R = 1 the rows are read from `x` [S, H] (the rows dispatch_meta was given; it staged
    nothing), required there;
    recv_w f32, recv_primary / recv_next / recv_src int32 [NvS] (this rank's, filled by every rank's
    dispatch_meta); out_rows [NvS, H] bf16/fp16/fp32, out_w f32, out_primary / out_next int32 [NvS];
    S: tokens per rank; status int32 [1]: STATUS_BAD_TABLE is OR-ed in for a skipped table entry."""
    need_rows("out_rows", out_rows)
    dev = out_rows.device
    NVS, H = out_rows.shape
    R = 1 if peer_send_rows is None else need_peers("peer_send_rows", peer_send_rows, device=dev)
    for n, t, dt in (("recv_w", recv_w, torch.float32), ("recv_primary", recv_primary, torch.int32),
                     ("recv_next", recv_next, torch.int32), ("recv_src", recv_src, torch.int32),
                     ("out_w", out_w, torch.float32), ("out_primary", out_primary, torch.int32),
                     ("out_next", out_next, torch.int32)):
        need_tensor(n, t, (dt,), shape=(NVS,), device=dev)
    S = need_int("S", S)
    need_status(status, dev)
    num_ctas = need_int("num_ctas", num_ctas)
    check_fits(S, 1, NVS, R, H * out_rows.element_size())
    if R == 1:
        if x is None:
            raise ValueError("dispatch_pull: with R = 1 the rows are read from x (dispatch_meta stages nothing); "
                             "pass the x given to dispatch_meta")
        need_rows("x", x, out_rows.dtype, (S, H), dev)
    fn = _compile_pull(S, H, R, NVS, out_rows.dtype, num_ctas)
    fn(x.view(-1) if R == 1 else peer_send_rows, recv_w, recv_primary, recv_next, recv_src, out_rows.view(-1),
       out_w, out_primary, out_next, status)


# ------------------------------------------------------------------------------------------------
# CI: compile every kernel for sm_90a without a GPU (run in a child by compile_check)
# ------------------------------------------------------------------------------------------------
def align_up(n: int, p: int) -> int:
    return (n + p - 1) // p * p


DEFAULT_CHECK_CONFIGS = [
    # the default benchmark shape: S=8192, H=7168, K=8, R=2, E=96 (epn=48), B=48, P=128
    dict(S=8192, H=7168, K=8, R=2, G=96, NVS=align_up(8192 * 8 + 127 * 96, 128), dtype="bfloat16"),
    dict(S=7, H=64, K=6, R=2, G=6, NVS=align_up(7 * 6 + 15 * 6, 16), dtype="bfloat16"),
    dict(S=7, H=72, K=6, R=4, G=6, NVS=align_up(7 * 6 + 15 * 6, 16), dtype="float32"),
    # one rank (pull reads x, meta stages nothing): S=8192, H=7168, K=8, E=48, P=128
    dict(S=8192, H=7168, K=8, R=1, G=48, NVS=align_up(8192 * 8 + 127 * 48, 128), dtype="bfloat16"),
]


def compile_all_for_check(configs: list[dict] | None = None, num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Compile meta and pull for each config; on a machine without a CUDA driver each compile stops
    at loading (caught: exactly DSLRuntimeError from CudaDriverDependencyError)."""
    from csrc_cute.compile_check import compile_and_report

    for cfg in configs or DEFAULT_CHECK_CONFIGS:
        S, H, K, R, G, NVS = (cfg[k] for k in ("S", "H", "K", "R", "G", "NVS"))
        dt = getattr(torch, cfg.get("dtype", "bfloat16"))
        for name, build in (("meta", lambda: _compile_meta(S, H, K, R, NVS, G, dt, num_ctas)),
                            ("pull", lambda: _compile_pull(S, H, R, NVS, dt, num_ctas))):
            compile_and_report(f"{name} S={S} H={H} K={K} R={R} G={G} NvS={NVS} {dt}", build)
