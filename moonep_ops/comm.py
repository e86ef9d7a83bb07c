"""Cross-rank traffic of the CPU reference ops, over torch.distributed (gloo).

The reference favours clarity over speed: every exchange is an `all_to_all_single` with host-side
split sizes. The CUDA implementations move the same bytes with NVLink writes and never sync the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .agreement import wait_in_op


def resolve_group(op: str, group_name: str, R: int | None = None):
    """The process group named `group_name`; checks its size against the configured R."""
    if not dist.is_initialized():
        raise RuntimeError(f"moonep.{op}: torch.distributed is not initialised (group_name={group_name!r})")
    group = _resolve_process_group(group_name)
    if R is not None and dist.get_world_size(group) != R:
        raise ValueError(f"moonep.{op}: R={R} but process group {group_name!r} has "
                         f"{dist.get_world_size(group)} ranks")
    return group


def exchange(per_dest: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send per_dest[d] to rank d; return what every rank sent to this one (index = source rank).

    All tensors share dtype and trailing shape; their first dimension may differ. Each collective is
    waited at most the running op's timeout (a peer that died mid-op fails this rank with a named error).
    """
    if dist.get_world_size(group) == 1:
        return _exchange_sized(per_dest, [per_dest[0].shape[0]], group)
    send_sizes = [t.shape[0] for t in per_dest]
    recv_sizes = torch.empty(len(per_dest), dtype=torch.int64)
    wait_in_op(dist.all_to_all_single(recv_sizes, torch.tensor(send_sizes, dtype=torch.int64), group=group,
                                      async_op=True), group)
    return _exchange_sized(per_dest, recv_sizes.tolist(), group)


def _exchange_sized(per_dest: list[torch.Tensor], recv_sizes: list[int], group) -> list[torch.Tensor]:
    """`exchange` where this rank already knows how many rows each peer sends it: one collective (none
    with one rank, whose rows come back to itself)."""
    if dist.get_world_size(group) == 1:
        return [per_dest[0].clone()]
    send = torch.cat(per_dest).contiguous()
    recv = send.new_empty((sum(recv_sizes),) + tuple(per_dest[0].shape[1:]))
    wait_in_op(dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes,
                                      input_split_sizes=[t.shape[0] for t in per_dest], group=group, async_op=True),
               group)
    return list(torch.split(recv, recv_sizes))


def pull(table: torch.Tensor, want_rank: torch.Tensor, want_row: torch.Tensor, group) -> torch.Tensor:
    """Read `table[want_row[i]]` of rank `want_rank[i]` for every i (every rank passes its own table)."""
    return pull_many([table], want_rank, want_row, group)[0]


def pull_many(tables: list[torch.Tensor], want_rank: torch.Tensor, want_row: torch.Tensor,
              group) -> list[torch.Tensor]:
    """`pull` from several tables at the same rows: the requests travel once, and each table's replies in
    one collective (a reply holds as many rows as its request, so no sizes are exchanged for it)."""
    R = dist.get_world_size(group)
    want_rank = want_rank.long()
    want_row = want_row.long()
    picks = [torch.nonzero(want_rank == d).flatten() for d in range(R)]
    requests = exchange([want_row[p] for p in picks], group)
    outs = []
    for table in tables:
        replies = _exchange_sized([table[req] for req in requests], [p.numel() for p in picks], group)
        out = table.new_zeros((want_rank.numel(),) + tuple(table.shape[1:]))
        for p, rep in zip(picks, replies):
            out[p] = rep
        outs.append(out)
    return outs
