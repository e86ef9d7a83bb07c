"""Dispatch data movement as CuTe DSL CUDA kernels: push token rows into the peers' receive buffers,
then duplicate them locally. No barrier inside: the caller runs a cross-rank barrier between the two.

Semantics (S tokens, K top-k, R ranks, NvS receive rows, G = epn+B groups; plan tables [S, K] int32
`dst_rank`, `dst_row`, `primary_row` as in `moonep_ops/planning.py`):

  dispatch_push   for every (s, k) with d = dst_rank[s, k], r = dst_row[s, k], on rank d:
                    w[r] = route_w[s, k], primary[r] = primary_row[s, k],
                    next[r] = dst_row[s, k'] of the next k' > k with dst_rank[s, k'] == d, else -1,
                    rows[r] = x[s] iff r == primary_row[s, k] (the token crosses to each rank once);
                  and this rank's own padding rows (past each group's real rows, and past the last
                  group end): rows 0, w 0, primary -1, next -1 (local writes).
  dispatch_finish local, after the barrier: out_rows[i] = recv_rows[recv_primary[i]] if
                  recv_primary[i] >= 0 else recv_rows[i]; out_w / out_primary / out_next = copies.

Peer arguments are int64 [R] tensors holding the device address of the same (16-byte aligned) buffer
on every rank. Rows move as 16-byte vectors (any row dtype with H * itemsize a multiple of 16):
each warp moves whole rows, lanes striding 16-byte chunks, U chunks per lane in flight per segment.
Entries with a destination rank outside [0, R) or a row outside [0, NvS) (a failed plan, flagged in
the plan's status word) are skipped.

Kernels (sm_90a, persistent grids of `num_ctas` CTAs, apache-tvm-ffi fast path, compiled once per
static key):
  push    one warp per token (grid-stride): lanes < K hold the token's k entries; match.any on the
          destination rank finds each entry's next row (the lowest higher lane with the same rank);
          a ballot of the carriers (dst_row == primary_row); each segment of x[s] is loaded once and
          stored to every carrier's row. Then the warps stride over this rank's padding rows (the
          padding ranges of 32 groups at a time, found by a ballot).
  finish  one warp per 32 rows: the lanes copy the metadata of 32 rows, then the warp copies the 32
          rows, each from its primary row.

Host wrappers: `dispatch_push`, `dispatch_finish`; `compile_all_for_check` for CI (see compile_check).
"""

# (no `from __future__ import annotations`: the DSL reads Constexpr annotations at runtime)

import threading

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Float32, Int32, Int64

from .plan import _ctz, _lanemask_lt, _match_any

_NT = 512          # threads per CTA (16 warps)
_U = 8             # 16-byte chunks per lane per segment (a warp keeps 4 KiB in flight)
DEFAULT_NUM_CTAS = 32
_ARCH_KEY = "sm_90a"

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
    return Int32(-1) ^ (_lanemask_lt() | (Int32(1) << lane))


def chunk_offsets(c0, lane, U: int, NC: int, clamp: bool):
    """Byte offsets (Int64) of this lane's U chunks of the segment starting at chunk c0."""
    offs = []
    for u in range(U):
        c = c0 + u * 32 + lane
        if clamp:
            c = cutlass.min(c, Int32(NC - 1))
        offs.append(Int64(c) * 16)
    return offs


def vec_tensor(dtype, addr, n: int):
    """n elements of `dtype` (16 bytes) at global address `addr` (16-byte aligned)."""
    return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=16),
                            cute.make_layout(n))


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


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
@cute.kernel
def _push_kernel(x: cute.Tensor, route_w: cute.Tensor, dst_rank: cute.Tensor, dst_row: cute.Tensor,
                 primary_row: cute.Tensor, peer_rows: cute.Tensor, peer_w: cute.Tensor,
                 peer_primary: cute.Tensor, peer_next: cute.Tensor, recv_rows: cute.Tensor,
                 recv_w: cute.Tensor, recv_primary: cute.Tensor, recv_next: cute.Tensor,
                 cu: cute.Tensor, grows: cute.Tensor, rank: Int32,
                 S: Constexpr[int], K: Constexpr[int], R: Constexpr[int], NVS: Constexpr[int],
                 G: Constexpr[int], ROWB: Constexpr[int], NCTA: Constexpr[int], NT: Constexpr[int],
                 U: Constexpr[int]):
    NW = NT // 32
    W = NCTA * NW
    NC, nfull, UT, clamp = row_geometry(ROWB, U)
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    gw = bx * NW + warp
    gt = lanemask_gt(lane)
    xa = addr_of(x)
    l_rows = addr_of(recv_rows)
    l_w = addr_of(recv_w)
    l_pr = addr_of(recv_primary)
    l_nx = addr_of(recv_next)
    kl = cutlass.min(lane, Int32(K - 1))

    # 1. tokens: one warp per token
    for s in cutlass.range(gw, S, W):
        idx = s * K + kl
        d = dst_rank[idx]
        r = dst_row[idx]
        pr = primary_row[idx]
        w = route_w[idx]
        ok = (lane < K) & (d >= 0) & (d < R) & (r >= 0) & (r < NVS)
        m = _match_any(cutlass.select_(ok, d, Int32(-1) - lane))
        later = m & gt
        nr = cute.arch.shuffle_sync(r, _ctz(cutlass.select_(later != 0, later, Int32(1))))
        nxt = cutlass.select_(later != 0, nr, Int32(-1))
        dc = cutlass.select_(ok, d, Int32(0))
        here = dc == rank
        a_rows = cutlass.select_(here, l_rows, peer_rows[dc])
        r64 = Int64(cutlass.select_(ok, r, Int32(0)))
        if ok:
            a_w = cutlass.select_(here, l_w, peer_w[dc])
            a_pr = cutlass.select_(here, l_pr, peer_primary[dc])
            a_nx = cutlass.select_(here, l_nx, peer_next[dc])
            store_scalar(Float32, a_w + r64 * 4, w)
            store_scalar(Int32, a_pr + r64 * 4, pr)
            store_scalar(Int32, a_nx + r64 * 4, nxt)
        car = cute.arch.vote_ballot_sync(ok & (r == pr))
        ncar = cute.arch.popc(car)
        dst = a_rows + r64 * ROWB
        src = xa + Int64(s) * ROWB
        if ncar > 0:
            for seg in cutlass.range(nfull):
                offs = chunk_offsets(seg * (32 * U), lane, U, NC, False)
                vals = load_chunks(src, offs)
                mm = car
                for _j in cutlass.range(ncar):
                    lj = _ctz(mm)
                    mm = mm & (mm - 1)
                    store_chunks(cute.arch.shuffle_sync(dst, lj), offs, vals)
            if cutlass.const_expr(UT > 0):
                offs = chunk_offsets(Int32(nfull * 32 * U), lane, UT, NC, clamp)
                vals = load_chunks(src, offs)
                mm = car
                for _j in cutlass.range(ncar):
                    lj = _ctz(mm)
                    mm = mm & (mm - 1)
                    store_chunks(cute.arch.shuffle_sync(dst, lj), offs, vals)

    # 2. this rank's padding rows: group g's rows [start_g + group_rows[g], cu[g]) and, as pseudo
    # group G, [cu[G-1], NvS); row i goes to the warp gw == i mod W
    last_end = cu[G - 1]
    for g0 in cutlass.range(0, G + 1, 32):
        g = g0 + lane
        gc = cutlass.min(g, Int32(G - 1))
        end = cu[gc]
        start = cutlass.select_(gc > 0, cu[cutlass.max(gc - 1, Int32(0))], Int32(0))
        nreal = cutlass.min(cutlass.max(grows[gc], Int32(0)), cutlass.max(end - start, Int32(0)))
        a = cutlass.select_(g == G, last_end, start + nreal)
        b = cutlass.select_(g == G, Int32(NVS), end)
        a = cutlass.max(a, Int32(0))
        b = cutlass.min(b, Int32(NVS))
        pm = cute.arch.vote_ballot_sync((g <= G) & (b > a))
        for _j in cutlass.range(cute.arch.popc(pm)):
            lj = _ctz(pm)
            pm = pm & (pm - 1)
            al = cute.arch.shuffle_sync(a, lj)
            bl = cute.arch.shuffle_sync(b, lj)
            off = gw - al % W
            off = cutlass.select_(off < 0, off + W, off)
            for i in cutlass.range(al + off, bl, W):
                dst = l_rows + Int64(i) * ROWB
                for seg in cutlass.range(nfull):
                    zero_segment(dst, seg * (32 * U), lane, U, NC, False)
                if cutlass.const_expr(UT > 0):
                    zero_segment(dst, Int32(nfull * 32 * U), lane, UT, NC, clamp)
                if lane == 0:
                    recv_w[i] = Float32(0.0)
                    recv_primary[i] = Int32(-1)
                    recv_next[i] = Int32(-1)


@cute.kernel
def _finish_kernel(recv_rows: cute.Tensor, recv_w: cute.Tensor, recv_primary: cute.Tensor,
                   recv_next: cute.Tensor, out_rows: cute.Tensor, out_w: cute.Tensor,
                   out_primary: cute.Tensor, out_next: cute.Tensor,
                   NVS: Constexpr[int], ROWB: Constexpr[int], NCTA: Constexpr[int],
                   NT: Constexpr[int], U: Constexpr[int]):
    NW = NT // 32
    W = NCTA * NW
    NC, nfull, UT, clamp = row_geometry(ROWB, U)
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    gw = bx * NW + warp
    ra = addr_of(recv_rows)
    oa = addr_of(out_rows)
    for i0 in cutlass.range(gw * 32, NVS, W * 32):
        i = i0 + lane
        ok = i < NVS
        ic = cutlass.min(i, Int32(NVS - 1))
        p = recv_primary[ic]
        w = recv_w[ic]
        n = recv_next[ic]
        if ok:
            out_w[i] = w
            out_primary[i] = p
            out_next[i] = n
        src = cutlass.select_((p >= 0) & (p < NVS), p, ic)
        src_a = ra + Int64(src) * ROWB
        for j in cutlass.range(cutlass.min(Int32(32), NVS - i0)):
            sa = cute.arch.shuffle_sync(src_a, j)
            da = oa + Int64(i0 + j) * ROWB
            for seg in cutlass.range(nfull):
                copy_segment(sa, da, seg * (32 * U), lane, U, NC, False)
            if cutlass.const_expr(UT > 0):
                copy_segment(sa, da, Int32(nfull * 32 * U), lane, UT, NC, clamp)


@cute.jit
def _push_launch(x: cute.Tensor, route_w: cute.Tensor, dst_rank: cute.Tensor, dst_row: cute.Tensor,
                 primary_row: cute.Tensor, peer_rows: cute.Tensor, peer_w: cute.Tensor,
                 peer_primary: cute.Tensor, peer_next: cute.Tensor, recv_rows: cute.Tensor,
                 recv_w: cute.Tensor, recv_primary: cute.Tensor, recv_next: cute.Tensor,
                 cu: cute.Tensor, grows: cute.Tensor, rank: Int32, stream,
                 S: Constexpr[int], K: Constexpr[int], R: Constexpr[int], NVS: Constexpr[int],
                 G: Constexpr[int], ROWB: Constexpr[int], NCTA: Constexpr[int]):
    _push_kernel(x, route_w, dst_rank, dst_row, primary_row, peer_rows, peer_w, peer_primary,
                 peer_next, recv_rows, recv_w, recv_primary, recv_next, cu, grows, rank,
                 S, K, R, NVS, G, ROWB, NCTA, _NT, _U).launch(
        grid=(NCTA, 1, 1), block=(_NT, 1, 1), stream=stream)


@cute.jit
def _finish_launch(recv_rows: cute.Tensor, recv_w: cute.Tensor, recv_primary: cute.Tensor,
                   recv_next: cute.Tensor, out_rows: cute.Tensor, out_w: cute.Tensor,
                   out_primary: cute.Tensor, out_next: cute.Tensor, stream,
                   NVS: Constexpr[int], ROWB: Constexpr[int], NCTA: Constexpr[int]):
    _finish_kernel(recv_rows, recv_w, recv_primary, recv_next, out_rows, out_w, out_primary,
                   out_next, NVS, ROWB, NCTA, _NT, _U).launch(
        grid=(NCTA, 1, 1), block=(_NT, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# compile cache (keyed by everything static) and fake arguments
# ------------------------------------------------------------------------------------------------
_CACHE: dict[tuple, object] = {}
_LOCK = threading.Lock()


def fake(dtype, n: int, align: int = 16):
    return cute.runtime.make_fake_compact_tensor(dtype, (n,), assumed_align=align)


def fake_stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def compiled(key: tuple, build):
    """The compiled function for `key` (built once, under a process-wide lock)."""
    key = key + (_ARCH_KEY,)
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            fn = build()
            _CACHE[key] = fn
    return fn


def _compile_push(S: int, H: int, K: int, R: int, NVS: int, G: int, dtype: torch.dtype, ncta: int):
    dt = ROW_DTYPES[dtype]
    rowb = H * dtype.itemsize

    def build():
        return cute.compile(
            _push_launch, fake(dt, S * H), fake(Float32, S * K, 4), fake(Int32, S * K, 4),
            fake(Int32, S * K, 4), fake(Int32, S * K, 4), fake(Int64, R, 8), fake(Int64, R, 8),
            fake(Int64, R, 8), fake(Int64, R, 8), fake(dt, NVS * H), fake(Float32, NVS, 4),
            fake(Int32, NVS, 4), fake(Int32, NVS, 4), fake(Int32, G, 4), fake(Int32, G, 4), Int32(0),
            fake_stream(), S, K, R, NVS, G, rowb, ncta, options="--enable-tvm-ffi")
    return compiled(("push", S, H, K, R, NVS, G, dtype, ncta), build)


def _compile_finish(NVS: int, H: int, dtype: torch.dtype, ncta: int):
    dt = ROW_DTYPES[dtype]
    rowb = H * dtype.itemsize

    def build():
        return cute.compile(
            _finish_launch, fake(dt, NVS * H), fake(Float32, NVS, 4), fake(Int32, NVS, 4),
            fake(Int32, NVS, 4), fake(dt, NVS * H), fake(Float32, NVS, 4), fake(Int32, NVS, 4),
            fake(Int32, NVS, 4), fake_stream(), NVS, rowb, ncta, options="--enable-tvm-ffi")
    return compiled(("finish", NVS, H, dtype, ncta), build)


# ------------------------------------------------------------------------------------------------
# host-side validation (no device reads, no syncs)
# ------------------------------------------------------------------------------------------------
def need_int(name: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def need_tensor(name: str, t, dtypes, shape=None, ndim=None, device=None, *, placement=True) -> torch.Tensor:
    """Check a tensor argument: dtype in `dtypes`, exact `shape` (None entries: any) or `ndim`; with
    `placement`, also on a CUDA device (the same as `device` if given) and contiguous."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is None and shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = tuple("*" if w is None else w for w in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if placement:
        need_placement(name, t, device)
    return t


def need_placement(name: str, t: torch.Tensor, device=None) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of the other inputs), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


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


def need_peers(name: str, t, R=None, device=None) -> int:
    need_tensor(name, t, (torch.int64,), shape=None if R is None else (R,), ndim=1, device=device)
    if t.numel() < 1:
        raise ValueError(f"{name} must hold at least one peer address")
    return t.numel()


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


def check_fits(S: int, K: int, NVS: int):
    if S * K >= 2 ** 31 - 1 or NVS >= 2 ** 31 - 32:
        raise ValueError(f"S*K={S * K} and NvS={NVS} must fit int32")


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------
def dispatch_push(x: torch.Tensor, route_w: torch.Tensor, dst_rank: torch.Tensor,
                  dst_row: torch.Tensor, primary_row: torch.Tensor, peer_rows: torch.Tensor,
                  peer_w: torch.Tensor, peer_primary: torch.Tensor, peer_next: torch.Tensor,
                  recv_rows: torch.Tensor, recv_w: torch.Tensor, recv_primary: torch.Tensor,
                  recv_next: torch.Tensor, cu_seqlens: torch.Tensor, group_rows: torch.Tensor,
                  rank: int, num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Push this rank's token rows and row metadata into every destination rank's receive buffers
    and reset this rank's own padding rows (see the module docstring). Returns nothing; launches on
    torch's current stream; the caller runs a cross-rank barrier before `dispatch_finish`.

    x [S, H] bf16/fp16/fp32; route_w [S, K] f32; dst_rank, dst_row, primary_row [S, K] int32;
    peer_rows / peer_w / peer_primary / peer_next int64 [R]: addresses of every rank's recv_rows
    [NvS, H] (x's dtype) / recv_w [NvS] f32 / recv_primary [NvS] int32 / recv_next [NvS] int32;
    recv_* this rank's buffers; cu_seqlens, group_rows int32 [G] (this rank's padded group ends and
    real rows per group)."""
    need_rows("x", x)
    dev = x.device
    S, H = x.shape
    S2, K = need_plan(dst_rank, dst_row, primary_row, dev)
    if S2 != S:
        raise ValueError(f"dst_rank must be [S, K] with S={S} (x's rows), got {tuple(dst_rank.shape)}")
    need_tensor("route_w", route_w, (torch.float32,), shape=(S, K), device=dev)
    R = need_peers("peer_rows", peer_rows, device=dev)
    for n, t in (("peer_w", peer_w), ("peer_primary", peer_primary), ("peer_next", peer_next)):
        need_peers(n, t, R, dev)
    need_rows("recv_rows", recv_rows, x.dtype, (None, H), dev)
    NVS = recv_rows.shape[0]
    need_tensor("recv_w", recv_w, (torch.float32,), shape=(NVS,), device=dev)
    need_tensor("recv_primary", recv_primary, (torch.int32,), shape=(NVS,), device=dev)
    need_tensor("recv_next", recv_next, (torch.int32,), shape=(NVS,), device=dev)
    need_tensor("cu_seqlens", cu_seqlens, (torch.int32,), ndim=1, device=dev)
    G = cu_seqlens.numel()
    if G < 1:
        raise ValueError("cu_seqlens must hold at least one group end")
    need_tensor("group_rows", group_rows, (torch.int32,), shape=(G,), device=dev)
    rank = need_int("rank", rank, 0)
    if rank >= R:
        raise ValueError(f"rank must be in [0, R={R}) (R = peer_rows.numel()), got {rank}")
    num_ctas = need_int("num_ctas", num_ctas)
    check_fits(S, K, NVS)
    fn = _compile_push(S, H, K, R, NVS, G, x.dtype, num_ctas)
    fn(x.view(-1), route_w.view(-1), dst_rank.view(-1), dst_row.view(-1), primary_row.view(-1),
       peer_rows, peer_w, peer_primary, peer_next, recv_rows.view(-1), recv_w, recv_primary,
       recv_next, cu_seqlens, group_rows, rank)


def dispatch_finish(recv_rows: torch.Tensor, recv_w: torch.Tensor, recv_primary: torch.Tensor,
                    recv_next: torch.Tensor, out_rows: torch.Tensor, out_w: torch.Tensor,
                    out_primary: torch.Tensor, out_next: torch.Tensor,
                    num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Local, after the barrier: out_rows[i] = recv_rows[recv_primary[i]] if recv_primary[i] >= 0
    else recv_rows[i]; out_w / out_primary / out_next = copies of recv_w / recv_primary / recv_next.
    Shapes: rows [NvS, H] (same dtype), w [NvS] f32, primary / next [NvS] int32."""
    need_rows("recv_rows", recv_rows)
    dev = recv_rows.device
    NVS, H = recv_rows.shape
    need_rows("out_rows", out_rows, recv_rows.dtype, (NVS, H), dev)
    for n, t, dt in (("recv_w", recv_w, torch.float32), ("recv_primary", recv_primary, torch.int32),
                     ("recv_next", recv_next, torch.int32), ("out_w", out_w, torch.float32),
                     ("out_primary", out_primary, torch.int32), ("out_next", out_next, torch.int32)):
        need_tensor(n, t, (dt,), shape=(NVS,), device=dev)
    num_ctas = need_int("num_ctas", num_ctas)
    check_fits(1, 1, NVS)
    fn = _compile_finish(NVS, H, recv_rows.dtype, num_ctas)
    fn(recv_rows.view(-1), recv_w, recv_primary, recv_next, out_rows.view(-1), out_w, out_primary,
       out_next)


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
]


def compile_all_for_check(configs: list[dict] | None = None, num_ctas: int = DEFAULT_NUM_CTAS) -> None:
    """Compile push and finish for each config; on a machine without a CUDA driver each compile stops
    at loading (caught: exactly DSLRuntimeError from CudaDriverDependencyError)."""
    from csrc_cute.compile_check import expect_no_driver

    for cfg in configs or DEFAULT_CHECK_CONFIGS:
        S, H, K, R, G, NVS = (cfg[k] for k in ("S", "H", "K", "R", "G", "NVS"))
        dt = getattr(torch, cfg.get("dtype", "bfloat16"))
        for name, build in (("push", lambda: _compile_push(S, H, K, R, NVS, G, dt, num_ctas)),
                            ("finish", lambda: _compile_finish(NVS, H, dt, num_ctas))):
            with expect_no_driver() as st:
                build()
            print(f"compiled {name} S={S} H={H} K={K} R={R} G={G} NvS={NVS} {dt}: "
                  + ("load failed: no CUDA driver (expected on CPU)" if st["driver_missing"]
                     else "no load error"),
                  flush=True)
