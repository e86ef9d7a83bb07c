"""The balanced EP planner as CuTe DSL CUDA kernels (simulation form: all R count rows on one GPU).

Bit-exact GPU counterpart of `moonep_ops/planning.py` (`plan_global`, `plan_tokens`). Nothing here
synchronises with the host: problems found on the device (bad expert ids, inconsistent counts or
plan inputs) set bits of an int32 status word instead of raising.

Absent tokens: expert id -1 in all K ids of a token marks it absent (S is the capacity). It is not
counted, gets dst_rank = dst_row = primary_row = -1, and sets no status bit; a token that mixes -1
with expert ids sets STATUS_BAD_EXPERT_ID (tok_hist checks it). Every rank routes at most S*K rows;
with N routed rows over all ranks, rank d's target is T_d = N // R + (1 if d < N % R else 0).

Kernels (sm_90a, launched through the apache-tvm-ffi fast path, compiled once per static shape):
  count        topk_ids [Rb, S*K] -> counts [Rb, E]      smem histogram per CTA, warp-aggregated
                                                          (match.any) atomics, then global atomics
                                                          (integer sums: deterministic).
  plan_global  counts [R, E] -> workspace [tot, pre, give, gave [E each], rfrom, rstart, ramt,
               otot, split [R each]]
               one CTA: totals and row sums in one pass (a row sum above S*K is flagged), per-rank
               surpluses load - T_d, the greedy rank loop in warp 0 (surpluses in registers,
               redux.sync max/min + ballot: ties to the lowest rank, at most R-1 steps), pre[e] =
               rows ranked before e in its donor's hottest-first order (found by counting, so the
               "sort" is exact and deterministic), then each donor's split (planning.donor_split):
               the interval cut's pieces counted per receiver, and the greedy split run in one warp
               per donor, one piece per step (redux.sync max quota, min rstart on ties), stopped at
               the cut's count; split[g] = 1 where the greedy makes fewer, its pieces in give
               [receiver, donor expert], gave[e] = rows expert e gives away (both splits).
  plan_expand  workspace -> alloc [E, R], experts_to_copy [R, B], experts_remote [R, epn-B],
               cu_seqlens and group_rows [R, 2*epn]
               CTA d: rows of home group d (tot - gave at home; to a receiver the interval overlap
               of [pre, pre+tot) with [rstart, rstart+ramt), or give for a greedy donor); warp 0: rank d's slot list, then its remote list (ballot +
               popc, ascending expert id), and padded cu_seqlens (warp scans chained by a carry).
               B = epn: every foreign expert gets a slot. B < epn: the CTA first ranks the foreign
               experts by (rows desc, id asc) by counting, O(epn^2 / 256); the first B get slots.
  tok_hist     this rank's ids, cut into warp chunks of whole tokens -> hist [NCH, E]
               (per-warp smem histogram, match.any leaders add, no atomics); flags tokens that mix
               the absent marker -1 with expert ids.
  tok_scan     exclusive scan of hist over chunks per expert, plus sum(counts[:rank, e]) -> base
               [NCH, E] (in place); cend [E, R] = row-wise cumsum of alloc.
  tok_assign   per warp chunk: position of each (s, k) in its expert's global sequence = base +
               stable in-chunk rank (match.any + running smem counters, rounds in s*K+k order);
               then destination rank (binary search over cend), group (home, or binary search in
               the destination's slot list, then in its remote list when B < epn), row, and the
               primary row (first k of the token on the same destination rank: match.any +
               shuffle). The searches are branch-free and interleaved over a warp's rounds so that
               their loads overlap.

The token kernels (tok_*) live in csrc_cute/plan_tokens.py, the warp helpers in csrc_cute/warp.py.

Host wrappers: `count_experts`, `plan_global_cuda`, `plan_tokens_cuda`, `plan_simulated`. Expert
lists of width 0 (B = 0, or no remote groups when B = epn) are [R, 0] tensors; the kernels never
touch them (compile-time branches), a 1-element stand-in is passed in their place.
"""

# (no `from __future__ import annotations`: the DSL reads Constexpr annotations at runtime)

from typing import NamedTuple

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32

from moonep_ops.checks import need_int, need_rank, need_status, need_tensor

from .jit import KernelFamily, compiler
from .plan_tokens import SMEM_LIMIT, checked_key, flag_bad_expert_ids, foreign_lists, tok_geometry, tok_launch
from .status import (  # the status bits the kernels set (part of this module's API)
    STATUS_BAD_COUNTS,
    STATUS_BAD_EXPERT_ID,
    STATUS_BAD_PLAN,
    STATUS_COUNTS_MISMATCH,
)
from .warp import ctz, lanemask_lt, match_any, overlap, ptr, warp_incl_scan, warp_sum

_NT_GLOBAL = 1024   # threads of the single plan_global CTA
_NT_EXPAND = 256    # threads per plan_expand CTA (one CTA per rank)
_NT_COUNT = 256     # threads per count CTA
_ITEMS_COUNT = 16   # ids per thread per count CTA
_I32_MIN = -(2 ** 31)
_I32_MAX = 2 ** 31 - 1


# ------------------------------------------------------------------------------------------------
# 1. count_experts
# ------------------------------------------------------------------------------------------------
@cute.kernel
def _count_kernel(ids: cute.Tensor, counts: cute.Tensor, status: cute.Tensor,
                  N: Constexpr[int], E: Constexpr[int], NT: Constexpr[int], IPT: Constexpr[int]):
    tidx, _, _ = cute.arch.thread_idx()
    bx, by, _ = cute.arch.block_idx()
    smem = cutlass.utils.SmemAllocator()
    h = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
    for e in cutlass.range(tidx, E, NT):
        h[e] = 0
    cute.arch.sync_threads()
    lt = lanemask_lt()
    start = bx * (NT * IPT)
    base = by * N
    keys = []
    bad = Int32(0)
    for j in cutlass.range_constexpr(IPT):
        i = start + j * NT + tidx
        ok = i < N
        key, bad = checked_key(ok, ids[base + cutlass.select_(ok, i, Int32(0))], E, bad)
        keys.append(key)
    for j in cutlass.range_constexpr(IPT):
        key = keys[j]
        m = match_any(key)
        if key >= 0:
            if cute.arch.popc(m & lt) == 0:
                cute.arch.atomic_add(ptr(h, key), cute.arch.popc(m))
    flag_bad_expert_ids(status, bad)
    cute.arch.sync_threads()
    for e in cutlass.range(tidx, E, NT):
        x = h[e]
        if x != 0:
            cute.arch.atomic_add(ptr(counts, by * E + e), x)


@cute.jit
def _count_launch(ids: cute.Tensor, counts: cute.Tensor, status: cute.Tensor, stream,
                  RB: Constexpr[int], N: Constexpr[int], E: Constexpr[int]):
    per_cta = _NT_COUNT * _ITEMS_COUNT
    _count_kernel(ids, counts, status, N, E, _NT_COUNT, _ITEMS_COUNT).launch(
        grid=((N + per_cta - 1) // per_cta, RB, 1), block=(_NT_COUNT, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# 2. plan_global (one CTA)
# ------------------------------------------------------------------------------------------------
@cute.kernel
def _plan_global_kernel(counts: cute.Tensor, ws: cute.Tensor, status: cute.Tensor,
                        R: Constexpr[int], E: Constexpr[int], TT: Constexpr[int], NT: Constexpr[int]):
    """One CTA: totals, loads, greedy flows, hottest-first offsets, each donor's split -> workspace
    ws = [tot[E], pre[E], give[E], gave[E], rfrom[R], rstart[R], ramt[R], otot[R], split[R]] (the
    layout _WS documents). TT = S*K, the most rows a rank routes; the targets T_d come from N, the sum
    of all row sums."""
    epn = E // R
    NW = NT // 32
    tidx, _, _ = cute.arch.thread_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    smem = cutlass.utils.SmemAllocator()
    tot = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
    cur = smem.allocate_tensor(Int32, cute.make_layout(R), byte_alignment=16)
    rows = smem.allocate_tensor(Int32, cute.make_layout(R), byte_alignment=16)
    rfrom = smem.allocate_tensor(Int32, cute.make_layout(R), byte_alignment=16)
    rstart = smem.allocate_tensor(Int32, cute.make_layout(R), byte_alignment=16)
    ramt = smem.allocate_tensor(Int32, cute.make_layout(R), byte_alignment=16)
    otot = smem.allocate_tensor(Int32, cute.make_layout(R), byte_alignment=16)
    ncut = smem.allocate_tensor(Int32, cute.make_layout(R), byte_alignment=16)
    rem = smem.allocate_tensor(Int32, cute.make_layout(R), byte_alignment=16)
    for r in cutlass.range(tidx, R, NT):
        rows[r] = 0
        rfrom[r] = -1
        rstart[r] = 0
        ramt[r] = 0
        otot[r] = 0
        ncut[r] = 0
    for i in cutlass.range(tidx, 2 * E, NT):  # give and gave: a greedy donor writes only its pieces
        ws[2 * E + i] = 0
    cute.arch.sync_threads()

    # one pass over counts: totals per expert (thread per expert) and row sums (warp sums added
    # into shared memory); negative counts are flagged
    UR = min(R, 16)
    for e0 in cutlass.range(0, E, NT):
        e = e0 + tidx
        ok = e < E
        ec = cutlass.min(e, Int32(E - 1))
        s = Int32(0)
        neg = Int32(0)
        for r0 in cutlass.range(0, R, UR):
            vals = []
            for u in cutlass.range_constexpr(UR):
                vals.append(counts[cutlass.min(r0 + u, Int32(R - 1)) * E + ec])
            for u in cutlass.range_constexpr(UR):
                c = cutlass.select_(ok & (r0 + u < R), vals[u], Int32(0))
                s = s + c
                neg = neg | cutlass.select_(c < 0, Int32(1), Int32(0))
                rsum = warp_sum(c)
                if lane == 0:
                    if r0 + u < R:
                        cute.arch.atomic_add(ptr(rows, r0 + u), rsum)
        if ok:
            tot[e] = s
            ws[e] = s
        if neg != 0:
            cute.arch.atomic_or(ptr(status, 0), Int32(STATUS_BAD_COUNTS))
    cute.arch.sync_threads()
    # every rank routes at most S*K rows
    for r in cutlass.range(tidx, R, NT):
        if rows[r] > TT:
            cute.arch.atomic_or(ptr(status, 0), Int32(STATUS_BAD_COUNTS))
    # home-group loads
    for g in cutlass.range(warp, R, NW):
        s = Int32(0)
        for i in cutlass.range(lane, epn, 32):
            s = s + tot[g * epn + i]
        s = warp_sum(s)
        if lane == 0:
            cur[g] = s
    cute.arch.sync_threads()

    # rank-level greedy (warp 0), at most R-1 steps: the rank g with the largest surplus load - T
    # fills the rank d with the largest deficit exactly to T_d (ties: lowest rank), where
    # T_d = N // R + (d < N % R) for N routed rows in all. Lane l keeps the surpluses of ranks l,
    # l+32, ... in registers; max/min by redux.sync, the lowest rank holding it by ballot.
    if warp == 0:
        NV = (R + 31) // 32
        n_all = Int32(0)
        for j in cutlass.range_constexpr(NV):
            n_all = n_all + cutlass.select_(j * 32 + lane < R, rows[cutlass.min(j * 32 + lane, Int32(R - 1))],
                                            Int32(0))
        n_all = warp_sum(n_all)
        t_base = n_all // R
        t_extra = n_all - t_base * R
        curs = []
        otots = []
        valids = []
        for j in cutlass.range_constexpr(NV):
            rr = j * 32 + lane
            valids.append(rr < R)
            target = t_base + cutlass.select_(rr < t_extra, Int32(1), Int32(0))
            curs.append(cur[cutlass.min(rr, Int32(R - 1))] - target)
            otots.append(Int32(0))
        done = Int32(0)
        for _step in cutlass.range_constexpr(R - 1):
            mx = Int32(_I32_MIN)
            mn = Int32(_I32_MAX)
            for j in cutlass.range_constexpr(NV):
                mx = cutlass.max(mx, cutlass.select_(valids[j], curs[j], Int32(_I32_MIN)))
                mn = cutlass.min(mn, cutlass.select_(valids[j], curs[j], Int32(_I32_MAX)))
            mx = cute.arch.warp_redux_sync(mx, "max")
            mn = cute.arch.warp_redux_sync(mn, "min")
            g = Int32(R)
            d = Int32(R)
            for j in reversed(range(NV)):
                bm = cute.arch.vote_ballot_sync(valids[j] & (curs[j] == mx))
                g = cutlass.select_(bm != 0, j * 32 + ctz(bm), g)
                bn = cute.arch.vote_ballot_sync(valids[j] & (curs[j] == mn))
                d = cutlass.select_(bn != 0, j * 32 + ctz(bn), d)
            active = (done == 0) & (mx > 0) & (g < R) & (d < R) & (g != d)
            done = cutlass.select_(active, done, Int32(1))
            amt = cutlass.select_(active, Int32(0) - mn, Int32(0))
            for j in cutlass.range_constexpr(NV):
                rr = j * 32 + lane
                isg = active & (rr == g)
                if isg:
                    rfrom[d] = g
                    rstart[d] = otots[j]
                    ramt[d] = amt
                otots[j] = otots[j] + cutlass.select_(isg, amt, Int32(0))
                curs[j] = (curs[j] - cutlass.select_(isg, amt, Int32(0))
                           + cutlass.select_(active & (rr == d), amt, Int32(0)))
        for j in cutlass.range_constexpr(NV):
            if valids[j]:
                otot[j * 32 + lane] = otots[j]
    cute.arch.sync_threads()

    # hottest-first position of each donor expert: rows of its group ranked before it
    # (total desc, expert id asc), found by counting
    for e in cutlass.range(tidx, E, NT):
        g = e // epn
        p = Int32(0)
        if otot[g] > 0:
            te = tot[e]
            for j in cutlass.range(epn):
                f = g * epn + j
                tf = tot[f]
                before = (tf > te) | ((tf == te) & (f < e))
                p = p + cutlass.select_(before, tf, Int32(0))
        ws[E + e] = p
    cute.arch.sync_threads()
    _choose_splits(ws, tot, rfrom, rstart, ramt, otot, ncut, rem, R, E, NT)
    for r in cutlass.range(tidx, R, NT):
        ws[4 * E + r] = rfrom[r]
        ws[4 * E + R + r] = rstart[r]
        ws[4 * E + 2 * R + r] = ramt[r]
        ws[4 * E + 3 * R + r] = otot[r]
        ws[4 * E + 4 * R + r] = ncut[r]  # _choose_splits left the donor's split here


@cute.jit
def _choose_splits(ws: cute.Tensor, tot: cute.Tensor, rfrom: cute.Tensor, rstart: cute.Tensor, ramt: cute.Tensor,
                   otot: cute.Tensor, ncut: cute.Tensor, rem: cute.Tensor, R: Constexpr[int], E: Constexpr[int],
                   NT: Constexpr[int]):
    """Per donor: the interval cut's piece count, then the greedy split in one warp, kept if it makes
    strictly fewer pieces (planning.donor_split). Called by the whole plan_global CTA after pre[e] is
    in ws; on return ncut[g] = 1 where donor g keeps the greedy split (its pieces are in give, the rows
    each expert gives away in gave, both in ws) and 0 otherwise, and gave holds every expert's."""
    epn = E // R
    NW = NT // 32
    tidx, _, _ = cute.arch.thread_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    # the cut's pieces: receiver d of donor g takes [rstart, rstart+ramt) of g's hottest-first rows,
    # one piece per expert of g that overlaps it
    for d in cutlass.range(tidx, R, NT):
        g = rfrom[d]
        if g >= 0:
            s0 = rstart[d]
            s1 = s0 + ramt[d]
            n = Int32(0)
            for j in cutlass.range(epn, unroll=4):
                te = tot[g * epn + j]
                a0 = ws[E + g * epn + j]
                n = n + cutlass.select_(overlap(a0, a0 + te, s0, s1) > 0, Int32(1), Int32(0))
            cute.arch.atomic_add(ptr(ncut, g), n)
        rem[d] = ramt[d]
    cute.arch.sync_threads()
    # the greedy split of donor g in warp g % NW, one piece per iteration: the current expert (the
    # positive one at row offset `off` of the hottest-first order) gives min(left, quota) rows to the
    # receiver with the largest remaining quota `rem` (ties: the earlier step, i.e. the lower rstart).
    # It stops at the cut's piece count: from there on it cannot make fewer.
    NV = (R + 31) // 32
    for g in cutlass.range(warp, R, NW):
        need = otot[g]
        limit = ncut[g]
        pieces = Int32(0)
        left = Int32(0)
        off = Int32(0)
        ie = Int32(0)
        while (need > 0) & (pieces < limit):
            if left == 0:
                found = Int32(epn)
                for i0 in cutlass.range(0, epn, 32):
                    i = i0 + lane
                    ic = cutlass.min(i, Int32(epn - 1))
                    te = tot[g * epn + ic]
                    hit = (i < epn) & (te > 0) & (ws[E + g * epn + ic] == off)
                    bal = cute.arch.vote_ballot_sync(hit)
                    found = cutlass.select_((bal != 0) & (found == epn), i0 + ctz(bal), found)
                ie = cutlass.min(found, Int32(epn - 1))
                te = tot[g * epn + ie]
                left = cutlass.min(te, need)
                off = off + te
                if lane == 0:
                    ws[3 * E + g * epn + ie] = left
            best = Int32(0)
            for j in cutlass.range_constexpr(NV):
                rr = cutlass.min(j * 32 + lane, Int32(R - 1))
                mine = (j * 32 + lane < R) & (rfrom[rr] == g)
                best = cutlass.max(best, cutlass.select_(mine, rem[rr], Int32(0)))
            best = cute.arch.warp_redux_sync(best, "max")
            first = Int32(_I32_MAX)
            for j in cutlass.range_constexpr(NV):
                rr = cutlass.min(j * 32 + lane, Int32(R - 1))
                mine = (j * 32 + lane < R) & (rfrom[rr] == g) & (rem[rr] == best)
                first = cutlass.min(first, cutlass.select_(mine, rstart[rr], Int32(_I32_MAX)))
            first = cute.arch.warp_redux_sync(first, "min")
            take = cutlass.min(left, best)
            for j in cutlass.range_constexpr(NV):
                rr = j * 32 + lane
                rc = cutlass.min(rr, Int32(R - 1))
                if (rr < R) & (rfrom[rc] == g) & (rstart[rc] == first):
                    rem[rc] = best - take
                    ws[2 * E + rc * epn + ie] = take
            cute.arch.sync_warp()
            pieces = pieces + 1
            left = left - take
            need = need - take
        if lane == 0:
            ncut[g] = cutlass.select_((need == 0) & (pieces < limit), Int32(1), Int32(0))
    cute.arch.sync_threads()
    # the rows each expert of a donor that keeps the cut gives away (a greedy donor's are written)
    for e in cutlass.range(tidx, E, NT):
        g = e // epn
        if (otot[g] > 0) & (ncut[g] == 0):
            a0 = ws[E + e]
            ws[3 * E + e] = overlap(a0, a0 + tot[e], Int32(0), otot[g])


def _received_rows(ws, g, split_g, d, i, s0, s1, E, epn):
    """Rows of expert i of donor g (>= 0 or -1: none) that rank d receives: give[d*epn + i] when g keeps
    the greedy split, else the overlap of the expert's [pre, pre+tot) with d's cut [s0, s1). Branch-free
    (loads clamped to row 0 when g < 0)."""
    gc = cutlass.max(g, Int32(0))
    te = ws[gc * epn + i]
    a0 = ws[E + gc * epn + i]
    cut = overlap(a0, a0 + te, s0, s1)
    v = cutlass.select_(split_g != 0, ws[2 * E + d * epn + i], cut)
    return cutlass.select_(g >= 0, v, Int32(0))


@cute.kernel
def _plan_expand_kernel(ws: cute.Tensor, alloc: cute.Tensor, e2c: cute.Tensor, erem: cute.Tensor,
                        cu: cute.Tensor, grows: cute.Tensor, R: Constexpr[int], E: Constexpr[int],
                        B: Constexpr[int], P: Constexpr[int], NT: Constexpr[int]):
    """CTA d: rows of home group d in alloc [E, R]; rank d's slot experts (e2c), remote experts
    (erem, B < epn only), padded group ends (cu) and real rows per group (grows).
    A donor that keeps the interval cut gives receiver dd the cut [rstart, rstart+ramt) of its
    hottest-first row sequence, of which expert e holds [pre[e], pre[e]+tot[e]); one that keeps the
    greedy split (split[g] = 1) gives it give[dd*epn + i] rows of its expert i. Either way expert e
    keeps tot[e] - gave[e] rows at home."""
    epn = E // R
    G = 2 * epn
    tidx, _, _ = cute.arch.thread_idx()
    d, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    lt = lanemask_lt()
    smem = cutlass.utils.SmemAllocator()
    rinfo = smem.allocate_tensor(Int32, cute.make_layout(5 * R), byte_alignment=16)
    gt = smem.allocate_tensor(Int32, cute.make_layout(epn), byte_alignment=16)
    gp = smem.allocate_tensor(Int32, cute.make_layout(epn), byte_alignment=16)
    gv = smem.allocate_tensor(Int32, cute.make_layout(epn), byte_alignment=16)
    for i in cutlass.range(tidx, 5 * R, NT):
        rinfo[i] = ws[4 * E + i]
    for i in cutlass.range(tidx, epn, NT):
        gt[i] = ws[d * epn + i]
        gp[i] = ws[E + d * epn + i]
        gv[i] = ws[3 * E + d * epn + i]
    cute.arch.sync_threads()
    split_d = rinfo[4 * R + d]
    for i in cutlass.range(tidx, epn * R, NT, unroll=4):
        ie = i // R
        dd = i - ie * R
        te = gt[ie]
        a0 = gp[ie]
        v = Int32(0)
        if dd == d:
            v = te - gv[ie]
        else:
            if rinfo[dd] == d:
                if split_d != 0:
                    v = ws[2 * E + dd * epn + ie]
                else:
                    s0 = rinfo[R + dd]
                    v = overlap(a0, a0 + te, s0, s0 + rinfo[2 * R + dd])
        alloc[d * epn * R + i] = v

    lists = foreign_lists(e2c, erem, B, epn)  # at trace time, before the dynamic regions
    # rank d receives the cut [s0, s1) of donor g's sequence (g = -1: it receives nothing)
    g = rinfo[d]
    s0 = rinfo[R + d]
    s1 = s0 + rinfo[2 * R + d]
    split_g = rinfo[4 * R + cutlass.max(g, Int32(0))] & cutlass.select_(g >= 0, Int32(1), Int32(0))
    if cutlass.const_expr(B < epn):
        # too few slots for every foreign expert: the B with the most rows on rank d (ties: lower
        # id) get them. frows[i] = rows of donor expert g*epn+i on d; fslot[i] = 1 if it has a slot,
        # by counting the foreign experts ranked before it (the whole CTA: O(epn^2 / NT))
        frows = smem.allocate_tensor(Int32, cute.make_layout(epn), byte_alignment=16)
        fslot = smem.allocate_tensor(Int32, cute.make_layout(epn), byte_alignment=16)
        for i in cutlass.range(tidx, epn, NT):
            frows[i] = _received_rows(ws, g, split_g, d, i, s0, s1, E, epn)
        cute.arch.sync_threads()
        for i in cutlass.range(tidx, epn, NT):
            v = frows[i]
            ahead = Int32(0)
            if v > 0:
                for j in cutlass.range(epn, unroll=4):
                    w = frows[j]
                    ahead = ahead + cutlass.select_((w > v) | ((w == v) & (j < i)), Int32(1), Int32(0))
            fslot[i] = cutlass.select_(ahead < B, Int32(1), Int32(0))
        cute.arch.sync_threads()

    if warp == 0:
        carry = Int32(0)
        for i0 in cutlass.range(0, epn, 32):
            i = i0 + lane
            ic = cutlass.min(i, Int32(epn - 1))
            te = gt[ic]
            ln = cutlass.select_(i < epn, te - gv[ic], Int32(0))
            pd = (ln + (P - 1)) // P * P
            inc = warp_incl_scan(pd, lane)
            if i < epn:
                cu[d * G + i] = carry + inc
                grows[d * G + i] = ln
            carry = carry + cute.arch.shuffle_sync(inc, 31)
        # foreign groups after the home ones: the slot list, then the remote list, each by ascending
        # expert id (ballot + popc); padded ends by warp scans chained by the carry; unused groups
        # are empty (-1 in the list, end = previous end)
        for lst, W, g0, want in lists:
            n = Int32(0)
            if g >= 0:
                for i0 in cutlass.range(0, epn, 32):
                    i = i0 + lane
                    ic = cutlass.min(i, Int32(epn - 1))
                    if cutlass.const_expr(B == epn):
                        # every foreign expert has a slot; its rows come straight from the workspace
                        rows = _received_rows(ws, g, split_g, d, ic, s0, s1, E, epn)
                        keep = (i < epn) & (rows > 0)
                    else:
                        rows = frows[ic]
                        keep = (i < epn) & (rows > 0) & (fslot[ic] == want)
                    bal = cute.arch.vote_ballot_sync(keep)
                    idx = n + cute.arch.popc(bal & lt)
                    inc = warp_incl_scan(cutlass.select_(keep, (rows + (P - 1)) // P * P, Int32(0)), lane)
                    if keep:
                        lst[d * W + idx] = g * epn + i
                        cu[d * G + g0 + idx] = carry + inc
                        grows[d * G + g0 + idx] = rows
                    carry = carry + cute.arch.shuffle_sync(inc, 31)
                    n = n + cute.arch.popc(bal)
            for j in cutlass.range(n + lane, W, 32):
                lst[d * W + j] = -1
                cu[d * G + g0 + j] = carry
                grows[d * G + g0 + j] = 0


@cute.jit
def _plan_global_launch(counts: cute.Tensor, ws: cute.Tensor, alloc: cute.Tensor, e2c: cute.Tensor,
                        erem: cute.Tensor, cu: cute.Tensor, grows: cute.Tensor, status: cute.Tensor, stream,
                        R: Constexpr[int], E: Constexpr[int], B: Constexpr[int], P: Constexpr[int],
                        TT: Constexpr[int]):
    _plan_global_kernel(counts, ws, status, R, E, TT, _NT_GLOBAL).launch(
        grid=(1, 1, 1), block=(_NT_GLOBAL, 1, 1), stream=stream)
    _plan_expand_kernel(ws, alloc, e2c, erem, cu, grows, R, E, B, P, _NT_EXPAND).launch(
        grid=(R, 1, 1), block=(_NT_EXPAND, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# compile cache (keyed by everything static) and fake arguments
# ------------------------------------------------------------------------------------------------
_JIT = KernelFamily("plan", (__name__,))


def _fake(dtype, n):
    return cute.runtime.make_fake_compact_tensor(dtype, (n,), assumed_align=4)


def _fake_stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def _cute_dtype(dt: torch.dtype):
    return cutlass.Int64 if dt == torch.int64 else cutlass.Int32


def _ws_len(R: int, E: int) -> int:
    """int32 elements of the plan workspace: tot, pre, give, gave [E each], then rfrom, rstart, ramt,
    otot, split [R each]."""
    return 4 * E + 5 * R


def _list_len(R: int, W: int) -> int:
    """Elements of an [R, W] expert list as a kernel argument. A list of width 0 (no slots, or no
    remote groups) is never touched; one int32 stands in for it, as kernel shapes are static."""
    return R * W if W else 1


def _list_arg(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.numel() else torch.empty(1, dtype=torch.int32, device=t.device)


@compiler
def _compile_count(RB: int, N: int, E: int, id_dtype: torch.dtype):
    def build():
        return cute.compile(_count_launch, _fake(_cute_dtype(id_dtype), RB * N), _fake(Int32, RB * E),
                            _fake(Int32, 1), _fake_stream(), RB, N, E, options="--enable-tvm-ffi")
    return _JIT.compiled(("count", RB, N, E, id_dtype), build)


@compiler
def _compile_global(R: int, E: int, B: int, P: int, TT: int):
    def build():
        epn = E // R
        return cute.compile(_plan_global_launch, _fake(Int32, R * E), _fake(Int32, _ws_len(R, E)),
                            _fake(Int32, E * R), _fake(Int32, _list_len(R, B)),
                            _fake(Int32, _list_len(R, epn - B)), _fake(Int32, R * 2 * epn),
                            _fake(Int32, R * 2 * epn), _fake(Int32, 1), _fake_stream(), R, E, B, P, TT,
                            options="--enable-tvm-ffi")
    return _JIT.compiled(("global", R, E, B, P, TT), build)


@compiler
def _compile_tokens(S: int, K: int, E: int, R: int, B: int, id_dtype: torch.dtype):
    def build():
        epn = E // R
        NCH = tok_geometry(S, K, E)[3]
        N = S * K
        return cute.compile(tok_launch, _fake(_cute_dtype(id_dtype), N), _fake(Int32, R * E),
                            _fake(Int32, E * R), _fake(Int32, _list_len(R, B)),
                            _fake(Int32, _list_len(R, epn - B)), _fake(Int32, R * 2 * epn),
                            _fake(Int32, NCH * E), _fake(Int32, E * R), _fake(Int32, N),
                            _fake(Int32, N), _fake(Int32, N), _fake(Int32, 1), Int32(0),
                            _fake_stream(), S, K, E, R, B, options="--enable-tvm-ffi")
    return _JIT.compiled(("tokens", S, K, E, R, B, id_dtype), build)


# ------------------------------------------------------------------------------------------------
# host-side validation
# ------------------------------------------------------------------------------------------------
def _status_tensor(status, device) -> torch.Tensor:
    if status is None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    return need_status(status, device)


def _check_plan_shapes(R, E, B, S, K, P=1):
    if E % R != 0:
        raise ValueError(f"E={E} must be a positive multiple of R={R}")
    if not 0 <= B <= E // R:
        raise ValueError(f"B must be in [0, epn={E // R}] (copy slots per rank), got B={B}")
    if K > 32:
        raise ValueError(f"K must be <= 32 (one token's ids fit a warp), got K={K}")
    if R * S * K >= 2 ** 31 - 1 or S * K + P * 2 * (E // R) >= 2 ** 31 - 1:
        raise ValueError(f"R*S*K={R * S * K} must fit int32")
    if E * 4 + 8 * R * 4 > SMEM_LIMIT:
        raise ValueError(f"E={E}, R={R}: plan_global keeps E+8*R int32 in 48 KiB of shared memory")


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------
class GPUGlobalPlan(NamedTuple):
    """The fields of planning.GlobalPlan, in its order."""
    alloc: torch.Tensor            # int32 [E, R]
    experts_to_copy: torch.Tensor  # int32 [R, B]
    cu_seqlens: torch.Tensor       # int32 [R, 2*epn]
    group_rows: torch.Tensor       # int32 [R, 2*epn]
    experts_remote: torch.Tensor   # int32 [R, epn-B]


class GPUTokenPlan(NamedTuple):
    dst_rank: torch.Tensor     # int32 [S, K]
    dst_row: torch.Tensor      # int32 [S, K]
    primary_row: torch.Tensor  # int32 [S, K]


def count_experts(topk_ids: torch.Tensor, E: int, status: torch.Tensor | None = None,
                  out: torch.Tensor | None = None):
    """topk_ids int32/int64 [S, K] (or [R, S, K] for all ranks) -> (counts int32 [E] (or [R, E]), status).

    Ids outside [0, E) are not counted and set STATUS_BAD_EXPERT_ID in `status` (int32 [1], OR-ed).
    `out`, if given, receives the counts (e.g. this rank's row of the symmetric count matrix)."""
    E = need_int("E", E)
    need_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), ndim=(2, 3))
    if topk_ids.numel() == 0:
        raise ValueError("topk_ids must not be empty")
    status = _status_tensor(status, topk_ids.device)
    batched = topk_ids.dim() == 3
    RB = topk_ids.shape[0] if batched else 1
    N = topk_ids.shape[-1] * topk_ids.shape[-2]
    if E * 4 > SMEM_LIMIT:
        raise ValueError(f"E={E}: the count kernel keeps E int32 in 48 KiB of shared memory")
    shape = (RB, E) if batched else (E,)
    if out is None:
        counts = torch.zeros(shape, dtype=torch.int32, device=topk_ids.device)
    else:
        counts = need_tensor("out", out, (torch.int32,), ndim=len(shape), device=topk_ids.device)
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {list(shape)}, got {list(out.shape)}")
        counts.zero_()
    fn = _compile_count(RB, N, E, topk_ids.dtype)
    fn(topk_ids.view(-1), counts.view(-1), status)
    return counts, status


def plan_global_cuda(counts: torch.Tensor, S: int, K: int, B: int, P: int,
                     status: torch.Tensor | None = None):
    """counts int32 [R, E] on the GPU -> (GPUGlobalPlan, status); equal to planning.plan_global.
    B in [0, epn]: copy slots per rank (the foreign experts that get none are read remotely)."""
    S, K, P = (need_int(n, v) for n, v in (("S", S), ("K", K), ("P", P)))
    B = need_int("B", B, 0)
    need_tensor("counts", counts, (torch.int32,), ndim=2)
    R, E = counts.shape
    if R < 1 or E < 1:
        raise ValueError(f"counts must be [R, E] with R, E >= 1, got {tuple(counts.shape)}")
    _check_plan_shapes(R, E, B, S, K, P)
    status = _status_tensor(status, counts.device)
    epn = E // R
    dev = counts.device
    alloc = torch.empty(E, R, dtype=torch.int32, device=dev)
    e2c = torch.empty(R, B, dtype=torch.int32, device=dev)
    erem = torch.empty(R, epn - B, dtype=torch.int32, device=dev)
    cu = torch.empty(R, 2 * epn, dtype=torch.int32, device=dev)
    grows = torch.empty(R, 2 * epn, dtype=torch.int32, device=dev)
    fn = _compile_global(R, E, B, P, S * K)
    ws = torch.empty(_ws_len(R, E), dtype=torch.int32, device=dev)
    fn(counts.view(-1), ws, alloc.view(-1), _list_arg(e2c), _list_arg(erem), cu.view(-1), grows.view(-1),
       status)
    return GPUGlobalPlan(alloc, e2c, cu, grows, erem), status


def plan_tokens_cuda(topk_ids: torch.Tensor, counts: torch.Tensor, plan, rank: int,
                     status: torch.Tensor | None = None):
    """Destinations of rank `rank`'s routed rows -> (GPUTokenPlan, status); equal to planning.plan_tokens.
    `plan`: the global plan (GPUGlobalPlan or planning.GlobalPlan on the GPU); its alloc,
    experts_to_copy, experts_remote and cu_seqlens are read."""
    need_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), ndim=2)
    dev = topk_ids.device
    need_tensor("counts", counts, (torch.int32,), ndim=2, device=dev)
    R, E = counts.shape
    S, K = topk_ids.shape
    if S < 1 or K < 1:
        raise ValueError(f"topk_ids must be [S, K] with S, K >= 1, got {tuple(topk_ids.shape)}")
    if E % R != 0:
        raise ValueError(f"counts: E={E} must be a positive multiple of R={R}")
    epn = E // R
    need_tensor("plan.experts_to_copy", plan.experts_to_copy, (torch.int32,), ndim=2, device=dev)
    B = plan.experts_to_copy.shape[1]
    if plan.experts_to_copy.shape[0] != R or B > epn:
        raise ValueError(f"plan.experts_to_copy must be [R, B] = [{R}, B <= epn={epn}], "
                         f"got {tuple(plan.experts_to_copy.shape)}")
    need_tensor("plan.alloc", plan.alloc, (torch.int32,), shape=(E, R), device=dev)
    need_tensor("plan.experts_remote", plan.experts_remote, (torch.int32,), shape=(R, epn - B), device=dev)
    need_tensor("plan.cu_seqlens", plan.cu_seqlens, (torch.int32,), shape=(R, 2 * epn), device=dev)
    rank = need_rank(rank, R)
    _check_plan_shapes(R, E, B, S, K)
    if 4 * E > SMEM_LIMIT:
        raise ValueError(f"E={E}: plan_tokens keeps E int32 per warp in 48 KiB of shared memory")
    status = _status_tensor(status, dev)
    NCH = tok_geometry(S, K, E)[3]
    hist = torch.empty(NCH * E, dtype=torch.int32, device=dev)
    cend = torch.empty(E * R, dtype=torch.int32, device=dev)
    dst_rank = torch.empty(S, K, dtype=torch.int32, device=dev)
    dst_row = torch.empty(S, K, dtype=torch.int32, device=dev)
    primary = torch.empty(S, K, dtype=torch.int32, device=dev)
    fn = _compile_tokens(S, K, E, R, B, topk_ids.dtype)
    fn(topk_ids.view(-1), counts.view(-1), plan.alloc.view(-1), _list_arg(plan.experts_to_copy),
       _list_arg(plan.experts_remote), plan.cu_seqlens.view(-1), hist, cend, dst_rank.view(-1),
       dst_row.view(-1), primary.view(-1), status, rank)
    return GPUTokenPlan(dst_rank, dst_row, primary), status


def plan_simulated(topk_ids_per_rank: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                   *, E: int | None = None, S: int | None = None, K: int | None = None, B: int,
                   P: int = 128, rank: int | None = None, status: torch.Tensor | None = None):
    """All R ranks on one GPU: count (from topk_ids_per_rank [R, S, K]) or take counts [R, E], plan
    globally, and, given `rank`, place that rank's tokens (needs topk_ids_per_rank). S is the
    capacity: tokens with -1 in all K ids are absent (each rank may route a different number).

    Returns (counts, GPUGlobalPlan, GPUTokenPlan or None, status)."""
    if (topk_ids_per_rank is None) == (counts is None):
        raise ValueError("pass exactly one of topk_ids_per_rank [R, S, K] and counts [R, E]")
    if topk_ids_per_rank is not None:
        need_tensor("topk_ids_per_rank", topk_ids_per_rank, (torch.int32, torch.int64), ndim=3)
        R, S_, K_ = topk_ids_per_rank.shape
        if S is not None and S != S_ or K is not None and K != K_:
            raise ValueError(f"S, K must match topk_ids_per_rank's shape {tuple(topk_ids_per_rank.shape)}")
        S, K = S_, K_
        if E is None:
            raise ValueError("E must be given with topk_ids_per_rank")
        E = need_int("E", E)
        if E % R != 0:
            raise ValueError(f"E={E} must be a positive multiple of R={R} (topk_ids_per_rank.shape[0])")
        status = _status_tensor(status, topk_ids_per_rank.device)
        counts, status = count_experts(topk_ids_per_rank, E, status)
    else:
        need_tensor("counts", counts, (torch.int32,), ndim=2)
        if S is None or K is None:
            raise ValueError("S and K must be given with counts")
        if E is not None and E != counts.shape[1]:
            raise ValueError(f"E={E} does not match counts.shape[1]={counts.shape[1]}")
        status = _status_tensor(status, counts.device)
    plan, status = plan_global_cuda(counts, S, K, B, P, status)
    tok = None
    if rank is not None:
        if topk_ids_per_rank is None:
            raise ValueError("rank needs topk_ids_per_rank (token placement needs the ids)")
        tok, status = plan_tokens_cuda(topk_ids_per_rank[rank], counts, plan, rank, status)
    return counts, plan, tok, status


# ------------------------------------------------------------------------------------------------
# CI: compile every planner kernel for sm_90a without a GPU (run in a child by compile_check)
# ------------------------------------------------------------------------------------------------
DEFAULT_CHECK_CONFIGS = [
    # (R, S, K, E, B, P, id dtype); B = epn trains, B < epn (inference) adds remote groups
    dict(R=8, S=8192, K=8, E=384, B=48, P=128, ids="int32"),
    dict(R=64, S=8192, K=8, E=2048, B=32, P=128, ids="int64"),
    dict(R=8, S=4096, K=8, E=384, B=4, P=128, ids="int32"),
    dict(R=2, S=7, K=6, E=12, B=0, P=16, ids="int64"),
]


def compile_all_for_check(configs: list[dict] | None = None) -> None:
    """Compile count, plan_global and plan_tokens for each config; on a machine without a CUDA driver
    each compile stops at loading (caught: exactly DSLRuntimeError from CudaDriverDependencyError)."""
    from csrc_cute.compile_check import compile_and_report

    for cfg in configs or DEFAULT_CHECK_CONFIGS:
        R, S, K, E, B, P = (cfg[k] for k in ("R", "S", "K", "E", "B", "P"))
        dt = torch.int64 if cfg.get("ids", "int32") == "int64" else torch.int32
        for build in (lambda: _compile_count(R, S * K, E, dt),
                      lambda: _compile_global(R, E, B, P, S * K),
                      lambda: _compile_tokens(S, K, E, R, B, dt)):
            compile_and_report(f"R={R} S={S} K={K} E={E} B={B} P={P} ids={dt}", build)
