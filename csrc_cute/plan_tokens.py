"""The token-destination kernels of the balanced EP planner (tok_hist, tok_scan, tok_assign; see
csrc_cute/plan.py's docstring for what each computes) and the device helpers they share with the
count and plan_expand kernels of csrc_cute/plan.py.

`tok_launch` runs the three kernels for one rank's ids; `tok_geometry` gives their warp-chunk shape
(the host side sizes the histogram with it). The host API (`plan_tokens_cuda`) and the compile cache
stay in csrc_cute/plan.py.
"""

# (no `from __future__ import annotations`: the DSL reads Constexpr annotations at runtime)

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32

from .status import STATUS_BAD_EXPERT_ID, STATUS_BAD_PLAN, STATUS_COUNTS_MISMATCH
from .warp import ctz, lanemask_lt, lower_bounds, match_any, ptr, searches, warp_incl_scan

_NW_SCAN = 8        # warps per tok_scan CTA (32 experts per CTA)
SMEM_LIMIT = 48 * 1024


# ------------------------------------------------------------------------------------------------
# expert-id checks and plan lists, shared with the count and plan_expand kernels
# ------------------------------------------------------------------------------------------------
def checked_key(ok, v, E, bad):
    """Expert id ``v`` read where ``ok``: (v if it is a valid expert id else -1, ``bad`` or-ed with
    whether it is out of [0, E) and not the absent-token marker -1)."""
    good = ok & (v >= 0) & (v < E)
    bad = bad | cutlass.select_(ok & (good == False) & (v != -1), Int32(1), Int32(0))  # noqa: E712
    return cutlass.select_(good, Int32(v), Int32(-1)), bad


@cute.jit
def flag_bad_expert_ids(status: cute.Tensor, bad):
    if bad != 0:
        cute.arch.atomic_or(ptr(status, 0), Int32(STATUS_BAD_EXPERT_ID))


def foreign_lists(e2c, erem, B, epn):
    """Rank d's foreign groups as (per-rank expert list, its width, its first group, is-slot), lists
    of width 0 left out: the B slots (groups epn..), then the epn - B remote groups (epn + B..)."""
    return [x for x in ((e2c, B, epn, 1), (erem, epn - B, epn + B, 0)) if x[1] > 0]


# ------------------------------------------------------------------------------------------------
# warp chunks of whole tokens
# ------------------------------------------------------------------------------------------------
def _warp_chunk(WPC, E):
    """Token kernels: WPC warps per CTA, warp w owning chunk bx * WPC + w and an E-entry int32 table
    in shared memory. Returns (lane, lanemask_lt, the tables, this warp's table offset, chunk)."""
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    lt = lanemask_lt()
    smem = cutlass.utils.SmemAllocator()
    tables = smem.allocate_tensor(Int32, cute.make_layout(WPC * E), byte_alignment=16)
    return lane, lt, tables, warp * E, bx * WPC + warp


@cute.jit
def _chunk_keys(ids: cute.Tensor, c, lane, S: Constexpr[int], K: Constexpr[int], E: Constexpr[int],
                TR: Constexpr[int], RPW: Constexpr[int]):
    """The ids of warp chunk ``c``: in round r, lane tk * K + kk (< TR * K) reads (s, k) = (c * TPC +
    r * TR + tk, kk). Per round: the checked key (-1 where invalid or no (s, k)), whether the lane has
    an (s, k), its flat index s * K + k (0 where not); then the lane's tk and whether any id was out
    of range (-1, an absent token, is not)."""
    TPC = RPW * TR
    tk = lane // K
    kk = lane - tk * K
    lane_ok = lane < TR * K
    keys = []
    oks = []
    flats = []
    bad = Int32(0)
    for r in cutlass.range_constexpr(RPW):
        t = c * TPC + r * TR + tk
        ok = lane_ok & (t < S)
        flat = cutlass.select_(ok, t * K + kk, Int32(0))
        key, bad = checked_key(ok, ids[flat], E, bad)
        keys.append(key)
        oks.append(ok)
        flats.append(flat)
    return keys, oks, flats, tk, bad


# ------------------------------------------------------------------------------------------------
# tok_hist, tok_scan, tok_assign
# ------------------------------------------------------------------------------------------------
def tok_geometry(S: int, K: int, E: int):
    """Warp chunks of whole tokens: rounds of TR = 32//K tokens (TR*K lanes busy), RPW rounds."""
    TR = 32 // K
    RPW = 8 if E < 1024 else 16
    TPC = RPW * TR
    NCH = (S + TPC - 1) // TPC
    WPC = max(1, min(2, SMEM_LIMIT // (4 * E)))
    return TR, RPW, TPC, NCH, WPC


@cute.kernel
def _tok_hist_kernel(ids: cute.Tensor, hist: cute.Tensor, status: cute.Tensor,
                     S: Constexpr[int], K: Constexpr[int], E: Constexpr[int],
                     TR: Constexpr[int], RPW: Constexpr[int], NCH: Constexpr[int],
                     WPC: Constexpr[int]):
    lane, lt, hs, hb, c = _warp_chunk(WPC, E)
    if c < NCH:
        for e in cutlass.range(lane, E, 32):
            hs[hb + e] = 0
        cute.arch.sync_warp()
        keys, oks, _, tk, bad = _chunk_keys(ids, c, lane, S, K, E, TR, RPW)
        for r in cutlass.range_constexpr(RPW):
            key = keys[r]
            m = match_any(key)
            if key >= 0:
                if cute.arch.popc(m & lt) == 0:
                    hs[hb + key] = hs[hb + key] + cute.arch.popc(m)
            cute.arch.sync_warp()
            # a token's K lanes are all routed or all absent (-1); fewer than K alike: mixed
            alike = match_any(cutlass.select_(oks[r], tk * 2 + cutlass.select_(key >= 0, Int32(1), Int32(0)),
                                               Int32(-1) - lane))
            bad = bad | cutlass.select_(oks[r] & (cute.arch.popc(alike) != K), Int32(1), Int32(0))
        flag_bad_expert_ids(status, bad)
        for e in cutlass.range(lane, E, 32):
            hist[c * E + e] = hs[hb + e]


@cute.kernel
def _tok_scan_kernel(hist: cute.Tensor, counts: cute.Tensor, alloc: cute.Tensor, cend: cute.Tensor,
                     status: cute.Tensor, rank: Int32, R: Constexpr[int], E: Constexpr[int],
                     NCH: Constexpr[int], NW: Constexpr[int]):
    CPW = (NCH + NW - 1) // NW
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    smem = cutlass.utils.SmemAllocator()
    part = smem.allocate_tensor(Int32, cute.make_layout(NW * 32), byte_alignment=16)
    e0 = bx * 32
    e = e0 + lane
    c0 = warp * CPW
    c1 = cutlass.min(c0 + CPW, Int32(NCH))
    ec = cutlass.min(e, Int32(E - 1))
    s = Int32(0)
    for cb in cutlass.range(c0, c1, 8):
        xs = []
        for u in cutlass.range_constexpr(8):
            xs.append(hist[cutlass.min(cb + u, c1 - 1) * E + ec])
        for u in cutlass.range_constexpr(8):
            s = s + cutlass.select_(cb + u < c1, xs[u], Int32(0))
    s = cutlass.select_(e < E, s, Int32(0))
    part[warp * 32 + lane] = s
    cute.arch.sync_threads()
    if warp == 0:
        if e < E:
            before = Int32(0)
            for rb in cutlass.range(0, rank, 8):
                xs = []
                for u in cutlass.range_constexpr(8):
                    xs.append(counts[cutlass.min(rb + u, Int32(R - 1)) * E + e])
                for u in cutlass.range_constexpr(8):
                    before = before + cutlass.select_(rb + u < rank, xs[u], Int32(0))
            run = before
            for w in cutlass.range_constexpr(NW):
                x = part[w * 32 + lane]
                part[w * 32 + lane] = run
                run = run + x
            if run - before != counts[rank * E + e]:
                cute.arch.atomic_or(ptr(status, 0), Int32(STATUS_COUNTS_MISMATCH))
    cute.arch.sync_threads()
    if e < E:
        run = part[warp * 32 + lane]
        for cb in cutlass.range(c0, c1, 8):
            xs = []
            for u in cutlass.range_constexpr(8):
                xs.append(hist[cutlass.min(cb + u, c1 - 1) * E + e])
            for u in cutlass.range_constexpr(8):
                if cb + u < c1:
                    hist[(cb + u) * E + e] = run
                run = run + cutlass.select_(cb + u < c1, xs[u], Int32(0))
    # cend[e, :] = cumsum(alloc[e, :]) for this CTA's 32 experts, one warp per expert
    for j in cutlass.range(warp, 32, NW):
        ee = e0 + j
        if ee < E:
            carry = Int32(0)
            for d0 in cutlass.range(0, R, 32):
                d = d0 + lane
                a = Int32(0)
                if d < R:
                    a = alloc[ee * R + d]
                inc = warp_incl_scan(a, lane)
                if d < R:
                    cend[ee * R + d] = carry + inc
                carry = carry + cute.arch.shuffle_sync(inc, 31)


@cute.kernel
def _tok_assign_kernel(ids: cute.Tensor, base: cute.Tensor, cend: cute.Tensor, alloc: cute.Tensor,
                       e2c: cute.Tensor, erem: cute.Tensor, cu: cute.Tensor, dst_rank: cute.Tensor,
                       dst_row: cute.Tensor, primary: cute.Tensor, status: cute.Tensor,
                       S: Constexpr[int], K: Constexpr[int], E: Constexpr[int], R: Constexpr[int],
                       B: Constexpr[int], TR: Constexpr[int], RPW: Constexpr[int],
                       NCH: Constexpr[int], WPC: Constexpr[int]):
    epn = E // R
    G = 2 * epn
    lists = foreign_lists(e2c, erem, B, epn)  # at trace time, before the dynamic regions
    lane, lt, cnt, hb, c = _warp_chunk(WPC, E)
    if c < NCH:
        UB = min(16, (E + 31) // 32)
        for e0 in cutlass.range(lane, E, 32 * UB):
            vals = []
            for u in cutlass.range_constexpr(UB):
                vals.append(base[c * E + cutlass.min(e0 + 32 * u, Int32(E - 1))])
            for u in cutlass.range_constexpr(UB):
                if e0 + 32 * u < E:
                    cnt[hb + e0 + 32 * u] = vals[u]
        cute.arch.sync_warp()
        keys, oks, flats, tk, bad = _chunk_keys(ids, c, lane, S, K, E, TR, RPW)
        flag_bad_expert_ids(status, bad)
        # stable position of each (s, k) in its expert's global sequence, rounds in s*K+k order
        idxs = []
        for r in cutlass.range_constexpr(RPW):
            key = keys[r]
            m = match_any(key)
            below = cute.arch.popc(m & lt)
            pos = Int32(0)
            if key >= 0:
                pos = cnt[hb + key] + below
            cute.arch.sync_warp()
            if key >= 0:
                if below == 0:
                    cnt[hb + key] = cnt[hb + key] + cute.arch.popc(m)
            cute.arch.sync_warp()
            idxs.append(pos)
        # destination rank d = smallest d with cend[e, d] > idx (searchsorted, right)
        kcs = [cutlass.max(keys[r], Int32(0)) for r in range(RPW)]
        los = searches(R, RPW, lambda r, d: cend[kcs[r] * R + d], lambda r, v: v <= idxs[r])
        # group of expert e on rank d: its home index, or its index in d's slot list, else in d's
        # remote list (ascending, -1 = end). Found nowhere: inconsistent plan inputs.
        dcs = []
        for r in cutlass.range_constexpr(RPW):
            dcs.append(cutlass.min(los[r], Int32(R - 1)))
        bounds = [lower_bounds(lst, W, dcs, kcs) for lst, W, _, _ in lists]
        dsts = los
        grps = []
        css = []
        flags = Int32(0)
        for r in cutlass.range_constexpr(RPW):
            kc = kcs[r]
            dc = dcs[r]
            grp = Int32(-1)
            for (lst, W, g0, _), lo in zip(lists, bounds):  # disjoint lists: at most one hit
                i = cutlass.min(lo[r], Int32(W - 1))
                hit = (lo[r] < W) & (lst[dc * W + i] == kc)
                grp = cutlass.select_(hit, g0 + i, grp)
            cs = cend[kc * R + dc] - alloc[kc * R + dc]
            hh = kc // epn
            grp = cutlass.select_(dsts[r] == hh, kc - hh * epn, grp)
            grp = cutlass.select_((keys[r] >= 0) & (dsts[r] < R), grp, Int32(-1))
            flags = flags | cutlass.select_((keys[r] >= 0) & (grp < 0), Int32(STATUS_BAD_PLAN), Int32(0))
            grps.append(grp)
            css.append(cs)
        if flags != 0:
            cute.arch.atomic_or(ptr(status, 0), flags)
        # group starts for all rounds (independent loads), rows
        rows = []
        for r in cutlass.range_constexpr(RPW):
            grp = grps[r]
            gv = cu[cutlass.select_(grp > 0, dsts[r] * G + grp - 1, Int32(0))]
            gstart = cutlass.select_(grp > 0, gv, Int32(0))
            rows.append(cutlass.select_(grp >= 0, gstart + idxs[r] - css[r], Int32(-1)))
            dsts[r] = cutlass.select_(grp >= 0, dsts[r], Int32(-1))
        # primary row: the first k of the token on the same destination rank
        for r in cutlass.range_constexpr(RPW):
            d = dsts[r]
            row = rows[r]
            key2 = cutlass.select_(d >= 0, tk * R + d, Int32(-1) - lane)
            m2 = match_any(key2)
            prow = cute.arch.shuffle_sync(row, ctz(m2))
            if oks[r]:
                f = flats[r]
                dst_rank[f] = d
                dst_row[f] = row
                primary[f] = cutlass.select_(d >= 0, prow, Int32(-1))


@cute.jit
def tok_launch(ids: cute.Tensor, counts: cute.Tensor, alloc: cute.Tensor, e2c: cute.Tensor,
                erem: cute.Tensor, cu: cute.Tensor, hist: cute.Tensor, cend: cute.Tensor, dst_rank: cute.Tensor,
                dst_row: cute.Tensor, primary: cute.Tensor, status: cute.Tensor, rank: Int32, stream,
                S: Constexpr[int], K: Constexpr[int], E: Constexpr[int], R: Constexpr[int],
                B: Constexpr[int]):
    TR, RPW, TPC, NCH, WPC = tok_geometry(S, K, E)
    nblk = (NCH + WPC - 1) // WPC
    _tok_hist_kernel(ids, hist, status, S, K, E, TR, RPW, NCH, WPC).launch(
        grid=(nblk, 1, 1), block=(32 * WPC, 1, 1), stream=stream)
    _tok_scan_kernel(hist, counts, alloc, cend, status, rank, R, E, NCH, _NW_SCAN).launch(
        grid=((E + 31) // 32, 1, 1), block=(32 * _NW_SCAN, 1, 1), stream=stream)
    _tok_assign_kernel(ids, hist, cend, alloc, e2c, erem, cu, dst_rank, dst_row, primary, status,
                       S, K, E, R, B, TR, RPW, NCH, WPC).launch(
        grid=(nblk, 1, 1), block=(32 * WPC, 1, 1), stream=stream)
