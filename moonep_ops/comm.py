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
    R = dist.get_world_size(group)
    if R == 1:
        return [per_dest[0].clone()]
    tail = per_dest[0].shape[1:]
    send_sizes = torch.tensor([t.shape[0] for t in per_dest], dtype=torch.int64)
    recv_sizes = torch.empty_like(send_sizes)
    wait_in_op(dist.all_to_all_single(recv_sizes, send_sizes, group=group, async_op=True), group)
    send = torch.cat(per_dest).contiguous()
    recv = send.new_empty((int(recv_sizes.sum()),) + tuple(tail))
    wait_in_op(dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes.tolist(),
                                      input_split_sizes=send_sizes.tolist(), group=group, async_op=True), group)
    return list(torch.split(recv, recv_sizes.tolist()))


def pull(table: torch.Tensor, want_rank: torch.Tensor, want_row: torch.Tensor, group) -> torch.Tensor:
    """Read `table[want_row[i]]` of rank `want_rank[i]` for every i (every rank passes its own table)."""
    R = dist.get_world_size(group)
    want_rank = want_rank.long()
    want_row = want_row.long()
    picks = [torch.nonzero(want_rank == d).flatten() for d in range(R)]
    requests = exchange([want_row[p] for p in picks], group)
    replies = exchange([table[req] for req in requests], group)
    out = table.new_zeros((want_rank.numel(),) + tuple(table.shape[1:]))
    for p, rep in zip(picks, replies):
        out[p] = rep
    return out
