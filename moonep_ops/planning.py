"""The balanced EP plan, as pure integer code on the CPU.

This module is the bit-exact reference of the GPU planner: every rank computes the same global plan
from the same `[R, E]` count matrix, and then the destinations of its own tokens.

Absent tokens: a rank may route fewer than S tokens in a step (S is the static capacity). An absent
token has expert id -1 in all K of its top-k ids; it is not counted, gets destination -1 and is never
sent or computed. With N = all ranks' routed rows (the sum of the count matrix), rank d computes
exactly T_d = N // R + (1 if d < N % R else 0) rows; with every token present T_d = S*K.

Global plan (`plan_global`), rank-level greedy, deterministic:
  1. `load[r]` = rows routed to rank r's home experts; the target of rank r is T_r (above), its
     surplus `load[r] - T_r` (negative: a deficit).
  2. Repeat: the rank g with the largest surplus (ties: lowest rank) fills the rank d with the largest
     deficit (ties: lowest rank) exactly to T_d from its home experts, until no surplus is positive.
     A receiver is filled in a single step and then never gives nor takes again, so each receiving
     rank takes experts of one home group only and never needs more than epn copy slots. A donor may
     give so much that it falls below its target; it is then filled later from another group like
     any other receiver. A donor never gives more than it holds at home (load[g] > T_g >= T_d - 1,
     so load[g] >= T_d >= the deficit). Every step finishes at least one rank, so there are at most
     R-1 steps.
  3. Each donor splits its outflows over its home experts taken hottest first (total desc, expert id
     asc): few experts cover a given number of rows, so few copies are made. Two splits, the one with
     fewer pieces (copies) kept, ties to the first: (a) the interval cut: the outflows, in step order,
     cut from the experts' rows as consecutive intervals; (b) the greedy split: each expert gives its
     rows to the outflow with the largest remaining quota (ties: the earlier step), split only when
     that quota is full. The choice is per donor, so a receiver still takes experts of one home group.
     What is left stays home.
Rows on rank d: home experts' groups first, then its B slots (copied experts, ascending id), then
its remote groups (ascending id); each group padded to a multiple of P. A rank's foreign experts all
come from its one donor group, so there are at most epn of them: with B = epn (training) every one
gets a slot; with B < epn (inference) the B with the most rows on the rank get slots and the others
are read from the donor's home weights through the peer mapping (remote groups). So a rank has
G = 2*epn groups whatever B is: epn home, B slots, epn - B remote. Tokens of expert e, ordered by
(source rank, s*K + k), are cut into consecutive chunks over destination ranks in ascending rank order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import check_int32_tables


class GlobalPlan(NamedTuple):
    alloc: torch.Tensor            # int32 [E, R]: rows of expert e computed on rank d
    experts_to_copy: torch.Tensor  # int32 [R, B]: copied experts hosted by each rank, ascending, -1 = empty
    cu_seqlens: torch.Tensor       # int32 [R, 2*epn]: padded group ends on each rank
    group_rows: torch.Tensor       # int32 [R, 2*epn]: real (unpadded) rows of each group on each rank
    experts_remote: torch.Tensor   # int32 [R, epn-B]: experts each rank reads remotely, ascending, -1 = empty

    @property
    def n_copies(self) -> int:
        return int((self.experts_to_copy >= 0).sum())


class TokenPlan(NamedTuple):
    dst_rank: torch.Tensor     # int32 [S, K]: rank that computes row (s, k); -1 for an absent token
    dst_row: torch.Tensor      # int32 [S, K]: row of (s, k) in that rank's receive buffer; -1 if absent
    primary_row: torch.Tensor  # int32 [S, K]: the row on dst_rank that carries token s over the link
                               # (its first k there); rows with dst_row != primary_row are local copies


def maxvio(counts: torch.Tensor) -> float:
    """max_e(T_e / mean_T) - 1 over the global per-expert token counts."""
    tot = counts.sum(0).double() if counts.dim() == 2 else counts.double()
    return float(tot.max() / tot.mean() - 1.0)


def rank_imbalance(counts: torch.Tensor) -> float:
    """max rank load / mean rank load, where a rank's load is its home experts' tokens."""
    R = counts.shape[0]
    load = counts.sum(0).view(R, -1).sum(1).double()
    return float(load.max() / load.mean())


ABSENT = -1  # the expert id that marks an absent token (all K of its ids)


def check_topk_ids(op: str, topk_ids: torch.Tensor, E: int) -> None:
    """Expert ids [S, K] must lie in [0, E), or be -1 (ABSENT) in all K ids of a token."""
    bad = ((topk_ids < ABSENT) | (topk_ids >= E)).nonzero()
    if bad.numel():
        s, k = (int(i) for i in bad[0])
        raise ValueError(f"{op}: topk_ids[{s}, {k}] = {int(topk_ids[s, k])} is outside [0, E={E}) "
                         f"(-1 marks an absent token)")
    absent = topk_ids == ABSENT
    mixed = (absent.any(1) & ~absent.all(1)).nonzero()
    if mixed.numel():
        s = int(mixed[0])
        raise ValueError(f"{op}: topk_ids[{s}] = {topk_ids[s].tolist()} mixes the absent-token marker -1 "
                         f"with expert ids (an absent token has -1 in all K ids)")


def count_routed(topk_ids: torch.Tensor, E: int) -> torch.Tensor:
    """int32 [E]: rows of `topk_ids` routed to each expert; absent tokens (-1) are not counted."""
    flat = topk_ids.reshape(-1).long()
    return torch.bincount(flat[flat >= 0], minlength=E).int()


def rank_targets(N: int, R: int) -> torch.Tensor:
    """int64 [R]: rows rank d computes when all ranks route N rows, T_d = N // R + (d < N % R)."""
    return N // R + (torch.arange(R) < N % R).long()


def _check_args(counts: torch.Tensor, S: int, K: int, B: int, P: int) -> None:
    """plan_global's arguments: the sizes as EPConfig checks them, and a count matrix of that shape."""
    for name, v in (("S", S), ("K", K), ("B", B), ("P", P)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"plan_global: {name} must be an int, got {type(v).__name__}")
    if not isinstance(counts, torch.Tensor) or counts.dim() != 2 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"plan_global: counts must be an int32/int64 [R, E] tensor, got "
                         f"{getattr(counts, 'dtype', type(counts).__name__)} {tuple(getattr(counts, 'shape', ()))}")
    R, E = counts.shape
    if R < 1 or E < 1 or E % R != 0:
        raise ValueError(f"plan_global: counts is [R={R}, E={E}]; E must be a positive multiple of R")
    if S < 1 or K < 1:
        raise ValueError(f"plan_global: S and K must be >= 1, got S={S}, K={K}")
    if not 0 <= B <= E // R:
        raise ValueError(f"plan_global: B must be in [0, epn] = [0, {E // R}], got B={B}")
    if P < 1 or P & (P - 1):  # the plan works for any power of two; EPConfig asks >= 16 for the kernels
        raise ValueError(f"plan_global: P must be a power of two, got P={P}")
    check_int32_tables("plan_global", S, K, R, E, P)
    if bool((counts < 0).any()):
        r, e = (int(i) for i in torch.nonzero(counts < 0)[0])
        raise ValueError(f"plan_global: counts must be non-negative, got counts[{r}, {e}] = {int(counts[r, e])}")
    per_rank = counts.long().sum(1)
    if bool((per_rank > S * K).any()):
        raise ValueError(f"plan_global: every rank routes at most S*K={S * K} rows (S tokens of capacity), "
                         f"got row sums {per_rank.tolist()}")


def rank_flows(load: torch.Tensor, target: torch.Tensor) -> list[tuple[int, int, int]]:
    """Step 2 of the plan: the (donor, receiver, rows) transfers, in step order."""
    surplus = load - target
    flows = []
    while True:
        g = int(torch.argmax(surplus))  # first maximum: lowest rank on ties
        if int(surplus[g]) <= 0:
            return flows
        d = int(torch.argmin(surplus))  # largest deficit, lowest rank on ties
        amt = -int(surplus[d])
        flows.append((g, d, amt))
        surplus[g] -= amt
        surplus[d] += amt


def hottest_first(tot_home: torch.Tensor) -> torch.Tensor:
    """Order of a home group's experts for cutting outflows: total desc, local id asc."""
    n = tot_home.numel()
    key = tot_home.long() * n + (n - 1 - torch.arange(n))  # larger total first, then lower id
    return torch.argsort(key, descending=True)


def interval_split(sizes: list[int], quotas: list[int]) -> list[tuple[int, int, int]]:
    """A donor's outflows cut, in step order, from its experts' rows taken in order (hottest first),
    as consecutive intervals -> pieces (expert position, outflow index, rows)."""
    pieces = []
    pos, left = 0, sizes[0]
    for j, amt in enumerate(quotas):
        while amt > 0:
            while left == 0:
                pos += 1
                left = sizes[pos]
            take = min(amt, left)
            pieces.append((pos, j, take))
            left -= take
            amt -= take
    return pieces


def greedy_split(sizes: list[int], quotas: list[int]) -> list[tuple[int, int, int]]:
    """Each expert in order (hottest first) gives its rows to the outflow with the largest remaining
    quota (ties: the earlier step), split only when that quota is full -> pieces as interval_split."""
    rem = list(quotas)
    need = sum(rem)
    pieces = []
    for pos, size in enumerate(sizes):
        left = min(size, need)
        while left > 0:
            j = max(range(len(rem)), key=lambda i: (rem[i], -i))
            take = min(left, rem[j])
            pieces.append((pos, j, take))
            rem[j] -= take
            left -= take
            need -= take
        if need == 0:
            return pieces
    return pieces


def donor_split(sizes: list[int], quotas: list[int]) -> list[tuple[int, int, int]]:
    """Step 3 of the plan for one donor: the interval cut or the greedy split, whichever makes fewer
    pieces (each piece is one expert copy on a receiver); ties keep the interval cut."""
    cut = interval_split(sizes, quotas)
    greedy = greedy_split(sizes, quotas)
    return greedy if len(greedy) < len(cut) else cut


def plan_global(counts: torch.Tensor, S: int, K: int, B: int, P: int) -> GlobalPlan:
    """counts int [R, E] (tokens of rank r routed to expert e) -> the global plan, identical on every rank."""
    _check_args(counts, S, K, B, P)
    R, E = counts.shape
    epn = E // R
    tot = counts.long().sum(0)
    load = tot.view(R, epn).sum(1)
    target = rank_targets(int(tot.sum()), R)

    alloc = torch.zeros(E, R, dtype=torch.long)
    alloc[torch.arange(E), torch.arange(E) // epn] = tot
    outflows: dict[int, list[tuple[int, int]]] = {}
    for g, d, amt in rank_flows(load, target):
        outflows.setdefault(g, []).append((d, amt))
    for g, flows in outflows.items():
        order = (hottest_first(tot[g * epn:(g + 1) * epn]) + g * epn).tolist()
        sizes = [int(tot[e]) for e in order]
        quotas = [amt for _, amt in flows]
        for pos, j, take in donor_split(sizes, quotas):
            e, d = order[pos], flows[j][0]
            alloc[e, d] += take
            alloc[e, g] -= take

    home = torch.arange(E) // epn
    foreign = (alloc > 0) & (home[:, None] != torch.arange(R)[None, :])  # [E, R]
    donors = [set((torch.nonzero(foreign[:, d]).flatten() // epn).tolist()) for d in range(R)]
    assert all(len(g) <= 1 for g in donors), "the rank-level policy gives every receiver one donor"
    experts_to_copy = torch.full((R, B), -1, dtype=torch.long)
    experts_remote = torch.full((R, epn - B), -1, dtype=torch.long)
    group_len = torch.zeros(R, 2 * epn, dtype=torch.long)
    for d in range(R):
        slots, remote = split_slots(alloc[:, d], foreign[:, d], B)
        experts_to_copy[d, :slots.numel()] = slots
        experts_remote[d, :remote.numel()] = remote
        group_len[d, :epn] = alloc[d * epn:(d + 1) * epn, d]
        group_len[d, epn:epn + slots.numel()] = alloc[slots, d]
        group_len[d, epn + B:epn + B + remote.numel()] = alloc[remote, d]
    padded = (group_len + P - 1) // P * P
    cu_seqlens = padded.cumsum(1)
    return GlobalPlan(alloc.int(), experts_to_copy.int(), cu_seqlens.int(), group_len.int(), experts_remote.int())


def split_slots(rows: torch.Tensor, foreign: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's foreign experts -> (slot experts, remote experts), each by ascending id. The B experts
    with the most rows on the rank (ties: lower id) get the slots: every M tile of a remote group reads
    its weights over NVLink, so the slots go where the tiles are."""
    ids = torch.nonzero(foreign).flatten()                        # ascending id
    order = torch.argsort(-rows[ids].long(), stable=True)          # most rows first, then id
    slots = ids[order[:B]].sort().values
    remote = ids[order[B:]].sort().values
    return slots, remote


def group_of_expert(plan: GlobalPlan, E: int) -> torch.Tensor:
    """int64 [R, E]: group index of expert e in rank d's buffer, -1 where d computes none of e."""
    R = plan.cu_seqlens.shape[0]
    epn = E // R
    out = torch.full((R, E), -1, dtype=torch.long)
    for d in range(R):
        out[d, d * epn:(d + 1) * epn] = torch.arange(epn)
        foreign = torch.cat([plan.experts_to_copy[d], plan.experts_remote[d]]).long()  # groups epn, epn+1, ...
        used = foreign >= 0
        out[d, foreign[used]] = epn + torch.nonzero(used).flatten()
    return out


def plan_tokens(topk_ids: torch.Tensor, counts: torch.Tensor, plan: GlobalPlan, rank: int) -> TokenPlan:
    """Destinations (rank, row) of rank `rank`'s routed rows, and which of them cross the link.
    Absent tokens (ids -1) get dst_rank = dst_row = primary_row = -1."""
    S, K = topk_ids.shape
    R, E = counts.shape
    flat = topk_ids.reshape(-1).long()
    routed = torch.nonzero(flat >= 0).flatten()   # in s*K+k order
    ids = flat[routed]
    # position of each routed (s, k) among this rank's rows of the same expert, in s*K+k order
    sorted_ids, perm = torch.sort(ids, stable=True)
    seg_start = torch.searchsorted(sorted_ids, torch.arange(E))
    local = torch.empty_like(ids)
    local[perm] = torch.arange(ids.numel()) - seg_start[sorted_ids]
    # position in the expert's global sequence, ordered by source rank first
    before = counts.long()[:rank].sum(0)
    idx = before[ids] + local
    # the chunk of the expert's sequence that each destination rank computes
    alloc = plan.alloc.long()
    chunk_end = alloc.cumsum(1)                       # [E, R]
    dst = torch.searchsorted(chunk_end[ids], idx[:, None], right=True).squeeze(1)
    chunk_start = chunk_end[ids, dst] - alloc[ids, dst]
    group = group_of_expert(plan, E)[dst, ids]
    cu = plan.cu_seqlens.long()
    group_start = torch.cat([torch.zeros(R, 1, dtype=torch.long), cu[:, :-1]], 1)[dst, group]
    dst_rank = torch.full((S * K,), -1, dtype=torch.long)
    dst_row = torch.full((S * K,), -1, dtype=torch.long)
    dst_rank[routed] = dst
    dst_row[routed] = group_start + idx - chunk_start
    dst_rank = dst_rank.view(S, K)
    dst_row = dst_row.view(S, K)
    # first k of each (token, destination rank) carries the row; later ones copy it on the receiver
    # (an absent token's ids are all -1, so its primary row is its dst_row, -1)
    same = dst_rank[:, :, None] == dst_rank[:, None, :]           # [S, K(k), K(k')]
    first = torch.argmax(same.int(), dim=2)                       # lowest k' with the same rank
    primary_row = torch.gather(dst_row, 1, first)
    return TokenPlan(dst_rank.int(), dst_row.int(), primary_row.int())
