"""The EP MoE path users run today, as the baseline of our benchmarks.

Router -> top-k -> permute (sort rows by expert) -> split sizes to the host -> NCCL/gloo
`all_to_all_single` of the token rows -> regroup by local expert -> `torch._grouped_mm` SwiGLU ->
the reverse all_to_all -> unpermute and weighted sum over K. Differentiable through
`torch.distributed.nn.functional.all_to_all_single`. Host syncs on the split sizes, data-dependent
shapes: what moonep_ops removes. `BaselineMoE` is that layer as an nn.Module (nn.Linear router, this rank's
experts as parameters); `BaselineBlock` / `BaselineModel` the residual blocks of moonep_ops.MoEModel around it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as Fn
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from moonep_ops.routing import route


class BaselineRoute(NamedTuple):
    """What the reverse path needs: the permutation, the split sizes (host ints), the regrouping."""
    order: torch.Tensor
    send_sizes: list[int]
    recv_sizes: list[int]
    regroup: torch.Tensor
    offs: torch.Tensor  # int32 [epn] cumulative rows per local expert


def baseline_dispatch(x: torch.Tensor, ids: torch.Tensor, E: int, group=None) -> tuple[torch.Tensor, BaselineRoute]:
    """Token rows [S, H] and top-k ids [S, K] -> this rank's rows grouped by local expert, and the route."""
    group = group or dist.group.WORLD
    R = dist.get_world_size(group)
    epn = E // R
    K = ids.shape[1]
    # permute: (s, k) rows sorted by expert, so each destination rank's rows are contiguous
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // K]
    per_expert = torch.bincount(flat, minlength=E)
    send = per_expert.view(R, epn).sum(1)
    recv_per_expert = torch.empty_like(per_expert)  # [R(source), epn] counts of rows this rank gets
    dist.all_to_all_single(recv_per_expert, per_expert, group=group)
    send_sizes, recv_sizes = send.tolist(), recv_per_expert.view(R, epn).sum(1).tolist()  # host sync
    recv = all_to_all_single(rows.new_empty(sum(recv_sizes), x.shape[1]), rows, recv_sizes, send_sizes, group=group)
    # received rows are ordered (source rank, expert): regroup them by local expert
    local_expert = torch.repeat_interleave(torch.arange(epn, device=x.device).repeat(R),
                                           recv_per_expert.view(-1))
    regroup = torch.argsort(local_expert, stable=True)
    offs = torch.bincount(local_expert, minlength=epn).cumsum(0).to(torch.int32)
    return recv[regroup], BaselineRoute(order, send_sizes, recv_sizes, regroup, offs)


def baseline_combine(out_grouped: torch.Tensor, weights: torch.Tensor, route: BaselineRoute, group=None
                     ) -> torch.Tensor:
    """Expert outputs grouped by local expert -> [S, H]: back to the source ranks, unpermuted, each token's
    K rows summed with its route weights."""
    group = group or dist.group.WORLD
    S, K = weights.shape
    back = torch.empty_like(out_grouped).index_copy(0, route.regroup, out_grouped)
    returned = all_to_all_single(back.new_empty(sum(route.send_sizes), back.shape[1]), back, route.send_sizes,
                                 route.recv_sizes, group=group)
    rows_out = torch.empty_like(returned).index_copy(0, route.order, returned).view(S, K, -1)
    return (rows_out.float() * weights[:, :, None]).sum(1).to(out_grouped.dtype)


def baseline_moe(x: torch.Tensor, router_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, K: int, E: int, group=None, normalize_topk: bool = True) -> torch.Tensor:
    """x [S, H] on this rank; router_w [E, H] (replicated); w_gate/w_up [epn, H, F], w_down [epn, F, H]
    (this rank's experts e = rank*epn + i) -> [S, H]."""
    weights, ids = route(x @ router_w.t(), K, normalize_topk)
    grouped, rt = baseline_dispatch(x, ids, E, group)
    hidden = Fn.silu(torch._grouped_mm(grouped, w_gate, offs=rt.offs)) * torch._grouped_mm(grouped, w_up, offs=rt.offs)
    out_grouped = torch._grouped_mm(hidden.to(x.dtype), w_down, offs=rt.offs)
    return baseline_combine(out_grouped, weights, rt, group)


class BaselineMoE(nn.Module):
    """The standard EP MoE layer: the same steps as benchmarks.baseline_ep.baseline_moe (route, dispatch
    with host split sizes and NCCL all_to_all_single, torch._grouped_mm SwiGLU, combine), with its router
    as an nn.Linear (wrapped in ForcedRouter by the benchmark) and this rank's experts as parameters."""

    def __init__(self, S: int, H: int, F: int, K: int, E: int, R: int, dtype, device, group=None):
        super().__init__()
        self.K, self.E, self.group = K, E, group
        epn = E // R
        self.router = nn.Linear(H, E, bias=False, dtype=dtype, device=device)
        self.w_gate = nn.Parameter(torch.empty(epn, H, F, dtype=dtype, device=device))
        self.w_up = nn.Parameter(torch.empty(epn, H, F, dtype=dtype, device=device))
        self.w_down = nn.Parameter(torch.empty(epn, F, H, dtype=dtype, device=device))
        for w, fan_in in ((self.w_gate, H), (self.w_up, H), (self.w_down, F)):  # as MoEExperts
            nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(x), self.K)
        grouped, rt = baseline_dispatch(x, ids, self.E, self.group)
        hidden = Fn.silu(torch._grouped_mm(grouped, self.w_gate, offs=rt.offs)) * torch._grouped_mm(
            grouped, self.w_up, offs=rt.offs)
        out_grouped = torch._grouped_mm(hidden.to(x.dtype), self.w_down, offs=rt.offs)
        return baseline_combine(out_grouped, weights, rt, self.group)


class BaselineBlock(nn.Module):
    """moonep_ops.MoEBlock with the baseline MoE: x + mix(norm1(x)), then x + moe(norm2(x))."""

    def __init__(self, moe: nn.Module, H: int, dtype, device):
        super().__init__()
        self.norm1 = nn.RMSNorm(H, dtype=dtype, device=device)
        self.mix = nn.Linear(H, H, bias=False, dtype=dtype, device=device)
        self.norm2 = nn.RMSNorm(H, dtype=dtype, device=device)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.moe(self.norm2(x))


class BaselineModel(nn.Module):
    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
