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
  plan_global  counts [R, E] -> workspace [tot[E], pre[E], rfrom, rstart, ramt, otot [R each]]
               one CTA: totals and row sums in one pass (a row sum above S*K is flagged), per-rank
               surpluses load - T_d, the greedy rank loop in warp 0 (surpluses in registers,
               redux.sync max/min + ballot: ties to the lowest rank, at most R-1 steps), and pre[e] = rows ranked before e in its donor's hottest-first order
               (found by counting, so the "sort" is exact and deterministic).
  plan_expand  workspace -> alloc [E, R], experts_to_copy [R, B], experts_remote [R, epn-B],
               cu_seqlens and group_rows [R, 2*epn]
               CTA d: rows of home group d (the cuts are interval overlaps of [pre, pre+tot) with
               [rstart, rstart+ramt)); warp 0: rank d's slot list, then its remote list (ballot +
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
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from moonep_ops.checks import need_int, need_rank, need_tensor

from .jit import KernelFamily
from .status import (  # the status bits the kernels set
    STATUS_BAD_COUNTS,
    STATUS_BAD_EXPERT_ID,
    STATUS_BAD_PLAN,
    STATUS_COUNTS_MISMATCH,
)

_NT_GLOBAL = 1024   # threads of the single plan_global CTA
_NT_EXPAND = 256    # threads per plan_expand CTA (one CTA per rank)
_NT_COUNT = 256     # threads per count CTA
_ITEMS_COUNT = 16   # ids per thread per count CTA
_NW_SCAN = 8        # warps per tok_scan CTA (32 experts per CTA)
_SMEM_LIMIT = 48 * 1024
_I32_MIN = -(2 ** 31)
_I32_MAX = 2 ** 31 - 1


# ------------------------------------------------------------------------------------------------
# device helpers (plain Python on DSL values; no dynamic `if`, so they need no AST rewriting)
# ------------------------------------------------------------------------------------------------
@dsl_user_op
def _match_any(val, *, loc=None, ip=None) -> Int32:
    """match.any.sync.b32 over the full warp: mask of lanes holding the same value."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(val).ir_value(loc=loc, ip=ip)],
        "match.any.sync.b32 $0, $1, -1;", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def _lanemask_lt(*, loc=None, ip=None) -> Int32:
    return Int32(cute.arch.nvvm.read_ptx_sreg_lanemask_lt(T.i32(), loc=loc, ip=ip))


def _ctz(m):
    """Index of the lowest set bit of a non-zero 32-bit mask."""
    return cute.arch.popc((m & (Int32(0) - m)) - Int32(1))


def _warp_incl_scan(x, lane):
    for i in range(5):
        y = cute.arch.shuffle_sync_up(x, 1 << i, mask_and_clamp=0)
        x = cutlass.select_(lane >= (1 << i), x + y, x)
    return x


def _warp_sum(x):
    return cute.arch.warp_redux_sync(Int32(x), "add")


def _warp_argbest(v, i, want_max: bool):
    """Butterfly arg-max/arg-min; ties go to the lowest index. Every lane gets the result."""
    for k in range(5):
        ov = cute.arch.shuffle_sync_bfly(v, 1 << k)
        oi = cute.arch.shuffle_sync_bfly(i, 1 << k)
        if want_max:
            better = (ov > v) | ((ov == v) & (oi < i))
        else:
            better = (ov < v) | ((ov == v) & (oi < i))
        v = cutlass.select_(better, ov, v)
        i = cutlass.select_(better, oi, i)
    return v, i


def _overlap(a0, a1, b0, b1):
    """Length of [a0, a1) ∩ [b0, b1) (0 if empty)."""
    lo = cutlass.max(a0, b0)
    hi = cutlass.min(a1, b1)
    return cutlass.max(hi - lo, Int32(0))


def _ptr(t, i):
    return (t.iterator + i).llvm_ptr


def _searches(n, rounds, load, before):
    """Per round r: the first index i in [0, n) with before(r, load(r, i)) false (n if none), that
    being true on a prefix. Branch-free binary searches (i clamped to n - 1), interleaved over the
    rounds so that their loads overlap."""
    los = [Int32(0) for _ in range(rounds)]
    his = [Int32(n) for _ in range(rounds)]
    for _it in range(n.bit_length()):
        for r in range(rounds):
            mid = (los[r] + his[r]) // 2
            x = load(r, cutlass.min(mid, Int32(n - 1)))
            act = los[r] < his[r]
            right = before(r, x)
            los[r] = cutlass.select_(act & right, mid + 1, los[r])
            his[r] = cutlass.select_(act & (right == False), mid, his[r])  # noqa: E712
    return los


def _lower_bounds(lst, W, rows, keys):
    """Per round r: the first index of row rows[r] of the [*, W] list lst (ascending, -1 = end) whose
    entry is not below keys[r] (W if none)."""
    return _searches(W, len(keys), lambda r, i: lst[rows[r] * W + i],
                     lambda r, x: (x >= 0) & (x < keys[r]))


def _checked_key(ok, v, E, bad):
    """Expert id ``v`` read where ``ok``: (v if it is a valid expert id else -1, ``bad`` or-ed with
    whether it is out of [0, E) and not the absent-token marker -1)."""
    good = ok & (v >= 0) & (v < E)
    bad = bad | cutlass.select_(ok & (good == False) & (v != -1), Int32(1), Int32(0))  # noqa: E712
    return cutlass.select_(good, Int32(v), Int32(-1)), bad


@cute.jit
def _flag_bad_expert_ids(status: cute.Tensor, bad):
    if bad != 0:
        cute.arch.atomic_or(_ptr(status, 0), Int32(STATUS_BAD_EXPERT_ID))


def _warp_chunk(WPC, E):
    """Token kernels: WPC warps per CTA, warp w owning chunk bx * WPC + w and an E-entry int32 table
    in shared memory. Returns (lane, lanemask_lt, the tables, this warp's table offset, chunk)."""
    tidx, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    lt = _lanemask_lt()
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
        key, bad = _checked_key(ok, ids[flat], E, bad)
        keys.append(key)
        oks.append(ok)
        flats.append(flat)
    return keys, oks, flats, tk, bad


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
    lt = _lanemask_lt()
    start = bx * (NT * IPT)
    base = by * N
    keys = []
    bad = Int32(0)
    for j in cutlass.range_constexpr(IPT):
        i = start + j * NT + tidx
        ok = i < N
        key, bad = _checked_key(ok, ids[base + cutlass.select_(ok, i, Int32(0))], E, bad)
        keys.append(key)
    for j in cutlass.range_constexpr(IPT):
        key = keys[j]
        m = _match_any(key)
        if key >= 0:
            if cute.arch.popc(m & lt) == 0:
                cute.arch.atomic_add(_ptr(h, key), cute.arch.popc(m))
    _flag_bad_expert_ids(status, bad)
    cute.arch.sync_threads()
    for e in cutlass.range(tidx, E, NT):
        x = h[e]
        if x != 0:
            cute.arch.atomic_add(_ptr(counts, by * E + e), x)


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
    """One CTA: totals, loads, greedy flows, hottest-first offsets -> workspace
    ws = [tot[E], pre[E], rfrom[R], rstart[R], ramt[R], otot[R]]. TT = S*K, the most rows a rank
    routes; the targets T_d come from N, the sum of all row sums."""
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
    for r in cutlass.range(tidx, R, NT):
        rows[r] = 0
        rfrom[r] = -1
        rstart[r] = 0
        ramt[r] = 0
        otot[r] = 0
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
                rsum = _warp_sum(c)
                if lane == 0:
                    if r0 + u < R:
                        cute.arch.atomic_add(_ptr(rows, r0 + u), rsum)
        if ok:
            tot[e] = s
            ws[e] = s
        if neg != 0:
            cute.arch.atomic_or(_ptr(status, 0), Int32(STATUS_BAD_COUNTS))
    cute.arch.sync_threads()
    # every rank routes at most S*K rows
    for r in cutlass.range(tidx, R, NT):
        if rows[r] > TT:
            cute.arch.atomic_or(_ptr(status, 0), Int32(STATUS_BAD_COUNTS))
    # home-group loads
    for g in cutlass.range(warp, R, NW):
        s = Int32(0)
        for i in cutlass.range(lane, epn, 32):
            s = s + tot[g * epn + i]
        s = _warp_sum(s)
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
        n_all = _warp_sum(n_all)
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
                g = cutlass.select_(bm != 0, j * 32 + _ctz(bm), g)
                bn = cute.arch.vote_ballot_sync(valids[j] & (curs[j] == mn))
                d = cutlass.select_(bn != 0, j * 32 + _ctz(bn), d)
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
    for r in cutlass.range(tidx, R, NT):
        ws[2 * E + r] = rfrom[r]
        ws[2 * E + R + r] = rstart[r]
        ws[2 * E + 2 * R + r] = ramt[r]
        ws[2 * E + 3 * R + r] = otot[r]


def _foreign_lists(e2c, erem, B, epn):
    """Rank d's foreign groups as (per-rank expert list, its width, its first group, is-slot), lists
    of width 0 left out: the B slots (groups epn..), then the epn - B remote groups (epn + B..)."""
    return [x for x in ((e2c, B, epn, 1), (erem, epn - B, epn + B, 0)) if x[1] > 0]


@cute.kernel
def _plan_expand_kernel(ws: cute.Tensor, alloc: cute.Tensor, e2c: cute.Tensor, erem: cute.Tensor,
                        cu: cute.Tensor, grows: cute.Tensor, R: Constexpr[int], E: Constexpr[int],
                        B: Constexpr[int], P: Constexpr[int], NT: Constexpr[int]):
    """CTA d: rows of home group d in alloc [E, R]; rank d's slot experts (e2c), remote experts
    (erem, B < epn only), padded group ends (cu) and real rows per group (grows).
    Donor outflows are consecutive cuts [rstart, rstart+ramt) of the donor's hottest-first row
    sequence; expert e holds [pre[e], pre[e]+tot[e]) of it."""
    epn = E // R
    G = 2 * epn
    tidx, _, _ = cute.arch.thread_idx()
    d, _, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = cute.arch.lane_idx()
    lt = _lanemask_lt()
    smem = cutlass.utils.SmemAllocator()
    rinfo = smem.allocate_tensor(Int32, cute.make_layout(4 * R), byte_alignment=16)
    gt = smem.allocate_tensor(Int32, cute.make_layout(epn), byte_alignment=16)
    gp = smem.allocate_tensor(Int32, cute.make_layout(epn), byte_alignment=16)
    for i in cutlass.range(tidx, 4 * R, NT):
        rinfo[i] = ws[2 * E + i]
    for i in cutlass.range(tidx, epn, NT):
        gt[i] = ws[d * epn + i]
        gp[i] = ws[E + d * epn + i]
    cute.arch.sync_threads()
    od = rinfo[3 * R + d]
    for i in cutlass.range(tidx, epn * R, NT, unroll=4):
        ie = i // R
        dd = i - ie * R
        te = gt[ie]
        a0 = gp[ie]
        v = Int32(0)
        if dd == d:
            v = te - _overlap(a0, a0 + te, Int32(0), od)
        else:
            if rinfo[dd] == d:
                s0 = rinfo[R + dd]
                v = _overlap(a0, a0 + te, s0, s0 + rinfo[2 * R + dd])
        alloc[d * epn * R + i] = v

    lists = _foreign_lists(e2c, erem, B, epn)  # at trace time, before the dynamic regions
    # rank d receives the cut [s0, s1) of donor g's sequence (g = -1: it receives nothing)
    g = rinfo[d]
    s0 = rinfo[R + d]
    s1 = s0 + rinfo[2 * R + d]
    if cutlass.const_expr(B < epn):
        # too few slots for every foreign expert: the B with the most rows on rank d (ties: lower
        # id) get them. frows[i] = rows of donor expert g*epn+i on d; fslot[i] = 1 if it has a slot,
        # by counting the foreign experts ranked before it (the whole CTA: O(epn^2 / NT))
        frows = smem.allocate_tensor(Int32, cute.make_layout(epn), byte_alignment=16)
        fslot = smem.allocate_tensor(Int32, cute.make_layout(epn), byte_alignment=16)
        for i in cutlass.range(tidx, epn, NT):
            v = Int32(0)
            if g >= 0:
                te = ws[g * epn + i]
                a0 = ws[E + g * epn + i]
                v = _overlap(a0, a0 + te, s0, s1)
            frows[i] = v
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
            a0 = gp[ic]
            ln = cutlass.select_(i < epn, te - _overlap(a0, a0 + te, Int32(0), od), Int32(0))
            pd = (ln + (P - 1)) // P * P
            inc = _warp_incl_scan(pd, lane)
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
                        te = ws[g * epn + ic]
                        a0 = ws[E + g * epn + ic]
                        rows = _overlap(a0, a0 + te, s0, s1)
                        keep = (i < epn) & (rows > 0)
                    else:
                        rows = frows[ic]
                        keep = (i < epn) & (rows > 0) & (fslot[ic] == want)
                    bal = cute.arch.vote_ballot_sync(keep)
                    idx = n + cute.arch.popc(bal & lt)
                    inc = _warp_incl_scan(cutlass.select_(keep, (rows + (P - 1)) // P * P, Int32(0)), lane)
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
# 3. plan_tokens: chunk histograms, scan over chunks, assignment
# ------------------------------------------------------------------------------------------------
def _tok_geometry(S: int, K: int, E: int):
    """Warp chunks of whole tokens: rounds of TR = 32//K tokens (TR*K lanes busy), RPW rounds."""
    TR = 32 // K
    RPW = 8 if E < 1024 else 16
    TPC = RPW * TR
    NCH = (S + TPC - 1) // TPC
    WPC = max(1, min(2, _SMEM_LIMIT // (4 * E)))
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
            m = _match_any(key)
            if key >= 0:
                if cute.arch.popc(m & lt) == 0:
                    hs[hb + key] = hs[hb + key] + cute.arch.popc(m)
            cute.arch.sync_warp()
            # a token's K lanes are all routed or all absent (-1); fewer than K alike: mixed
            alike = _match_any(cutlass.select_(oks[r], tk * 2 + cutlass.select_(key >= 0, Int32(1), Int32(0)),
                                               Int32(-1) - lane))
            bad = bad | cutlass.select_(oks[r] & (cute.arch.popc(alike) != K), Int32(1), Int32(0))
        _flag_bad_expert_ids(status, bad)
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
                cute.arch.atomic_or(_ptr(status, 0), Int32(STATUS_COUNTS_MISMATCH))
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
                inc = _warp_incl_scan(a, lane)
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
    lists = _foreign_lists(e2c, erem, B, epn)  # at trace time, before the dynamic regions
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
        _flag_bad_expert_ids(status, bad)
        # stable position of each (s, k) in its expert's global sequence, rounds in s*K+k order
        idxs = []
        for r in cutlass.range_constexpr(RPW):
            key = keys[r]
            m = _match_any(key)
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
        los = _searches(R, RPW, lambda r, d: cend[kcs[r] * R + d], lambda r, v: v <= idxs[r])
        # group of expert e on rank d: its home index, or its index in d's slot list, else in d's
        # remote list (ascending, -1 = end). Found nowhere: inconsistent plan inputs.
        dcs = []
        for r in cutlass.range_constexpr(RPW):
            dcs.append(cutlass.min(los[r], Int32(R - 1)))
        bounds = [_lower_bounds(lst, W, dcs, kcs) for lst, W, _, _ in lists]
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
            cute.arch.atomic_or(_ptr(status, 0), flags)
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
            m2 = _match_any(key2)
            prow = cute.arch.shuffle_sync(row, _ctz(m2))
            if oks[r]:
                f = flats[r]
                dst_rank[f] = d
                dst_row[f] = row
                primary[f] = cutlass.select_(d >= 0, prow, Int32(-1))


@cute.jit
def _tok_launch(ids: cute.Tensor, counts: cute.Tensor, alloc: cute.Tensor, e2c: cute.Tensor,
                erem: cute.Tensor, cu: cute.Tensor, hist: cute.Tensor, cend: cute.Tensor, dst_rank: cute.Tensor,
                dst_row: cute.Tensor, primary: cute.Tensor, status: cute.Tensor, rank: Int32, stream,
                S: Constexpr[int], K: Constexpr[int], E: Constexpr[int], R: Constexpr[int],
                B: Constexpr[int]):
    TR, RPW, TPC, NCH, WPC = _tok_geometry(S, K, E)
    nblk = (NCH + WPC - 1) // WPC
    _tok_hist_kernel(ids, hist, status, S, K, E, TR, RPW, NCH, WPC).launch(
        grid=(nblk, 1, 1), block=(32 * WPC, 1, 1), stream=stream)
    _tok_scan_kernel(hist, counts, alloc, cend, status, rank, R, E, NCH, _NW_SCAN).launch(
        grid=((E + 31) // 32, 1, 1), block=(32 * _NW_SCAN, 1, 1), stream=stream)
    _tok_assign_kernel(ids, hist, cend, alloc, e2c, erem, cu, dst_rank, dst_row, primary, status,
                       S, K, E, R, B, TR, RPW, NCH, WPC).launch(
        grid=(nblk, 1, 1), block=(32 * WPC, 1, 1), stream=stream)


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


def _list_len(R: int, W: int) -> int:
    """Elements of an [R, W] expert list as a kernel argument. A list of width 0 (no slots, or no
    remote groups) is never touched; one int32 stands in for it, as kernel shapes are static."""
    return R * W if W else 1


def _list_arg(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.numel() else torch.empty(1, dtype=torch.int32, device=t.device)


def _compile_count(RB: int, N: int, E: int, id_dtype: torch.dtype):
    def build():
        return cute.compile(_count_launch, _fake(_cute_dtype(id_dtype), RB * N), _fake(Int32, RB * E),
                            _fake(Int32, 1), _fake_stream(), RB, N, E, options="--enable-tvm-ffi")
    return _JIT.compiled(("count", RB, N, E, id_dtype), build)


def _compile_global(R: int, E: int, B: int, P: int, TT: int):
    def build():
        epn = E // R
        return cute.compile(_plan_global_launch, _fake(Int32, R * E), _fake(Int32, 2 * E + 4 * R),
                            _fake(Int32, E * R), _fake(Int32, _list_len(R, B)),
                            _fake(Int32, _list_len(R, epn - B)), _fake(Int32, R * 2 * epn),
                            _fake(Int32, R * 2 * epn), _fake(Int32, 1), _fake_stream(), R, E, B, P, TT,
                            options="--enable-tvm-ffi")
    return _JIT.compiled(("global", R, E, B, P, TT), build)


def _compile_tokens(S: int, K: int, E: int, R: int, B: int, id_dtype: torch.dtype):
    def build():
        epn = E // R
        NCH = _tok_geometry(S, K, E)[3]
        N = S * K
        return cute.compile(_tok_launch, _fake(_cute_dtype(id_dtype), N), _fake(Int32, R * E),
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
    need_tensor("status", status, (torch.int32,), ndim=1, device=device)
    if status.numel() != 1:
        raise ValueError(f"status must hold exactly 1 int32 element, got {status.numel()}")
    return status


def _check_plan_shapes(R, E, B, S, K, P=1):
    if E % R != 0:
        raise ValueError(f"E={E} must be a positive multiple of R={R}")
    if not 0 <= B <= E // R:
        raise ValueError(f"B must be in [0, epn={E // R}] (copy slots per rank), got B={B}")
    if K > 32:
        raise ValueError(f"K must be <= 32 (one token's ids fit a warp), got K={K}")
    if R * S * K >= 2 ** 31 - 1 or S * K + P * 2 * (E // R) >= 2 ** 31 - 1:
        raise ValueError(f"R*S*K={R * S * K} must fit int32")
    if E * 4 + 6 * R * 4 > _SMEM_LIMIT:
        raise ValueError(f"E={E}, R={R}: plan_global keeps E+6*R int32 in 48 KiB of shared memory")


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
    if E * 4 > _SMEM_LIMIT:
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
    ws = torch.empty(2 * E + 4 * R, dtype=torch.int32, device=dev)
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
    if 4 * E > _SMEM_LIMIT:
        raise ValueError(f"E={E}: plan_tokens keeps E int32 per warp in 48 KiB of shared memory")
    status = _status_tensor(status, dev)
    NCH = _tok_geometry(S, K, E)[3]
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
