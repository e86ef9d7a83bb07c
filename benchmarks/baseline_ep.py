"""The EP MoE path users run today, as the baseline of our benchmarks.

Router -> top-k -> permute (sort rows by expert) -> split sizes to the host -> NCCL/gloo
`all_to_all_single` of the token rows -> regroup by local expert -> `torch._grouped_mm` SwiGLU ->
the reverse all_to_all -> unpermute and weighted sum over K. Differentiable through
`torch.distributed.nn.functional.all_to_all_single`. Host syncs on the split sizes, data-dependent
shapes: what moonep_ops removes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from moonep_ops.routing import route


def baseline_moe(x: torch.Tensor, router_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, K: int, E: int, group=None, normalize_topk: bool = True) -> torch.Tensor:
    """x [S, H] on this rank; router_w [E, H] (replicated); w_gate/w_up [epn, H, F], w_down [epn, F, H]
    (this rank's experts e = rank*epn + i) -> [S, H]."""
    group = group or dist.group.WORLD
    R = dist.get_world_size(group)
    epn = E // R
    S, H = x.shape
    weights, ids = route(x @ router_w.t(), K, normalize_topk)
    # permute: (s, k) rows sorted by expert, so each destination rank's rows are contiguous
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // K]
    per_expert = torch.bincount(flat, minlength=E)
    send = per_expert.view(R, epn).sum(1)
    recv_per_expert = torch.empty_like(per_expert)  # [R(source), epn] counts of rows this rank gets
    dist.all_to_all_single(recv_per_expert, per_expert, group=group)
    send_sizes, recv_sizes = send.tolist(), recv_per_expert.view(R, epn).sum(1).tolist()  # host sync
    recv = all_to_all_single(rows.new_empty(sum(recv_sizes), H), rows, recv_sizes, send_sizes, group=group)
    # received rows are ordered (source rank, expert): regroup them by local expert
    local_expert = torch.repeat_interleave(torch.arange(epn, device=x.device).repeat(R),
                                           recv_per_expert.view(-1))
    regroup = torch.argsort(local_expert, stable=True)
    grouped = recv[regroup]
    offs = torch.bincount(local_expert, minlength=epn).cumsum(0).to(torch.int32)
    hidden = F.silu(torch._grouped_mm(grouped, w_gate, offs=offs)) * torch._grouped_mm(grouped, w_up, offs=offs)
    out_grouped = torch._grouped_mm(hidden.to(x.dtype), w_down, offs=offs)
    back = torch.empty_like(out_grouped).index_copy(0, regroup, out_grouped)
    returned = all_to_all_single(back.new_empty(sum(send_sizes), H), back, send_sizes, recv_sizes, group=group)
    # unpermute and sum each token's K rows with its route weights
    rows_out = torch.empty_like(returned).index_copy(0, order, returned).view(S, K, H)
    return (rows_out.float() * weights[:, :, None]).sum(1).to(x.dtype)
