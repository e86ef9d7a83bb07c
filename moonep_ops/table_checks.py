"""Value checks of the index tables the CPU reference ops index with, run before an op writes anything.

The fake kernels (moonep_ops/fake/) check shapes and dtypes; these read the values, so they run in the real ops
only (the CUDA kernels flag the same cases in the status word instead: STATUS_BAD_TABLE). Each raises a
ValueError naming the op, the table, the first offending entry and the rule.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _raise_first(op: str, name: str, t: Tensor, bad: Tensor, rule: str) -> None:
    if bool(bad.any()):
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        at = ", ".join(map(str, idx))
        raise ValueError(f"moonep.{op}: {name}[{at}] = {int(t[idx])} {rule}")


def check_range(op: str, name: str, t: Tensor, lo: int, hi: int, what: str) -> None:
    """Every entry of `t` in [lo, hi); `what` names the bound, e.g. 'R=2'."""
    _raise_first(op, name, t, (t < lo) | (t >= hi), f"is outside [{lo}, {what})")


def check_token_tables(op: str, R: int, NvS: int, dst_rank: Tensor, dst_row: Tensor,
                       primary_row: Tensor | None = None) -> None:
    """dst_rank in [0, R), dst_row in [0, NvS); primary_row[s, k] = dst_row of token s's first k with the
    same destination rank (the row that carries the token there). An absent token's row is -1 in every
    table (ABSENT, moonep_ops/planning.py)."""
    absent = (dst_rank == -1) & (dst_row == -1)
    if primary_row is not None:
        absent &= primary_row == -1
    rule = "(-1 in every table marks an absent token)"
    _raise_first(op, "dst_rank", dst_rank, ~absent & ((dst_rank < 0) | (dst_rank >= R)), f"is outside [0, R={R}) {rule}")
    _raise_first(op, "dst_row", dst_row, ~absent & ((dst_row < 0) | (dst_row >= NvS)),
                 f"is outside [0, NvS={NvS}) {rule}")
    if primary_row is None:
        return
    _raise_first(op, "primary_row", primary_row, ~absent & ((primary_row < 0) | (primary_row >= NvS)),
                 f"is outside [0, NvS={NvS}) {rule}")
    same = dst_rank[:, :, None] == dst_rank[:, None, :]
    first = torch.argmax(same.int(), dim=2)
    want = torch.gather(dst_row, 1, first)
    _raise_first(op, "primary_row", primary_row, primary_row != want,
                 "is not the dst_row of the token's first k going to the same rank")


def check_unique_rows(op: str, dst_rank: Tensor, dst_row: Tensor, NvS: int) -> None:
    """No two routed rows share a destination (a duplicate would overwrite a token); absent rows (-1)
    have none."""
    key = (dst_rank.long() * NvS + dst_row.long()).reshape(-1)
    uniq, counts = torch.unique(key[dst_rank.reshape(-1) >= 0], return_counts=True)
    if bool((counts > 1).any()):
        dup = int(uniq[counts > 1][0])
        where = torch.nonzero(key == dup).flatten().tolist()[:2]
        K = dst_rank.shape[1]
        pos = " and ".join(f"[{i // K}, {i % K}]" for i in where)
        raise ValueError(f"moonep.{op}: dst_rank/dst_row{pos} both name row {dup % NvS} of rank {dup // NvS}: "
                         f"every routed row needs its own destination row")


def real_rows(op: str, cu_seqlens: Tensor, group_rows: Tensor, NvS: int) -> Tensor:
    """bool [NvS]: the rows that hold a routed row (the first group_rows[g] rows of each group g), after
    checking cu_seqlens (non-decreasing, at most NvS) and group_rows (within each group's length)."""
    ends = cu_seqlens.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    _raise_first(op, "cu_seqlens", cu_seqlens, (ends < starts) | (ends > NvS),
                 f"breaks the rule: cu_seqlens is non-decreasing and ends by NvS={NvS}")
    _raise_first(op, "group_rows", group_rows, (group_rows < 0) | (group_rows.long() > ends - starts),
                 "is outside [0, the group's length in cu_seqlens]")
    rows = torch.arange(NvS)
    group = torch.searchsorted(ends, rows, right=True).clamp(max=ends.numel() - 1)
    return (rows < ends[group]) & (rows - starts[group] < group_rows.long()[group])


def check_received(op: str, rows: Tensor, primary: Tensor, nxt: Tensor, src: Tensor, real: Tensor, S: int,
                   R: int) -> None:
    """The receiver's side of dispatch: the rows peers sent are the real rows of its groups, each exactly
    once; each names a carrier among them that carries the same token; next rows lie in the buffer."""
    NvS = real.numel()
    check_range(op, "a received dst_row", rows, 0, NvS, f"NvS={NvS}")
    seen = torch.zeros(NvS, dtype=torch.long).index_add_(0, rows.long(), torch.ones_like(rows, dtype=torch.long))
    for bad, rule in (((seen > 0) & ~real, "a padding row of its group (past group_rows), which must stay zero"),
                      (seen > 1, "a row that another routed row was sent to as well"),
                      ((seen == 0) & real, "a row that cu_seqlens/group_rows count as routed but no rank sent")):
        if bool(bad.any()):
            r = int(torch.nonzero(bad)[0])
            raise ValueError(f"moonep.{op}: the peers' dst_row tables name row {r} of this rank: {rule}")
    check_range(op, "a received primary_row", primary, 0, NvS, f"NvS={NvS}")
    check_range(op, "a received next row", nxt, -1, NvS, f"NvS={NvS}")
    check_range(op, "a received source", src, 0, R * S, f"R*S={R * S}")
    src_of = torch.full((NvS,), -1, dtype=torch.long)
    src_of[rows.long()] = src.long()
    _raise_first(op, "a received primary_row", primary, src_of[primary.long()] != src.long(),
                 "is not a row carrying the same token")


def check_row_tables(op: str, row_primary: Tensor, row_next: Tensor) -> None:
    """Per receive row: its carrier (-1 = padding; a carrier is its own) and next row, in [-1, NvS)."""
    NvS = row_primary.numel()
    check_range(op, "row_primary", row_primary, -1, NvS, f"NvS={NvS}")
    check_range(op, "row_next", row_next, -1, NvS, f"NvS={NvS}")
    valid = row_primary >= 0
    carrier = row_primary.long().clamp(min=0)
    _raise_first(op, "row_primary", row_primary, valid & (row_primary[carrier] != row_primary),
                 "names a row that is not a carrier (a carrier's row_primary is itself)")


def check_copies(op: str, experts_to_copy: Tensor, epn: int) -> None:
    """experts_to_copy [R, B]: -1 (empty slot) or a global expert id in [0, E = R*epn)."""
    E = experts_to_copy.shape[0] * epn
    check_range(op, "experts_to_copy", experts_to_copy, -1, E, f"E={E}")
