"""The routed-experts step as a public function: any router's top-k -> plan -> dispatch -> experts ->
combine. `MoELayer` is this function behind a router module; a model with its own router (or the
Hugging Face adapter, moonep_ops/hf.py) calls it directly."""

from __future__ import annotations

import torch

from . import autograd, ops
from .group import EPGroup


def _check_args(ep: EPGroup, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    c = ep.cfg
    if getattr(experts, "ep", None) is not ep:
        raise ValueError("moe_experts: experts must be a MoEExperts built on this EPGroup (experts.ep is ep)")
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moe_experts: {name} must be a tensor, got {type(t).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"moe_experts: x must be a floating tensor (the tokens' hidden states), got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != c.H:
        raise ValueError(f"moe_experts: x must be [s, H={c.H}] (tokens of this rank), got shape {tuple(x.shape)}")
    if x.shape[0] != c.S:
        raise ValueError(f"moe_experts: x holds {x.shape[0]} tokens, EPConfig.S={c.S}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise TypeError(f"moe_experts: topk_ids must be an integer tensor (expert ids), got {topk_ids.dtype}")
    if tuple(topk_ids.shape) != (c.S, c.K):
        raise ValueError(f"moe_experts: topk_ids must be [s={c.S}, K={c.K}], got shape {tuple(topk_ids.shape)}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"moe_experts: topk_weights must be a floating tensor, got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != (c.S, c.K):
        raise ValueError(f"moe_experts: topk_weights must be [s={c.S}, K={c.K}], got shape "
                         f"{tuple(topk_weights.shape)}")


def moe_experts(ep: EPGroup, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k topk_weights[s, k] * expert_{topk_ids[s, k]}(x[s]) over the EP group: (out [s, H] in x's
    dtype, counts [R, E] int32, every rank's tokens per expert).

    x [s, H] (this rank's tokens, any float dtype: computed in ep.dtype); topk_ids [s, K] integer in
    [0, E) (the plan op rejects others); topk_weights [s, K] (computed in fp32; differentiable, like x
    and the experts' weights). `experts` is this rank's `MoEExperts`. Collective: every rank of the EP
    group calls it once per layer with its own tokens.
    """
    _check_args(ep, experts, x, topk_ids, topk_weights)
    c = ep.cfg
    tokens = x.to(ep.dtype).contiguous()
    route_w = topk_weights.float().contiguous()
    dst_rank, dst_row, primary_row, experts_to_copy, experts_remote, cu_seqlens, group_rows, counts = ops.plan(
        topk_ids.contiguous(), c.E, c.B, c.P, c.R, ep.ctrl, ep.group_name)
    rows, row_w, row_primary, row_next = autograd.dispatch(ep, tokens, route_w, dst_rank, dst_row, primary_row,
                                                           cu_seqlens, group_rows)
    out_rows = experts(rows, row_w, cu_seqlens, experts_to_copy, experts_remote)
    out = autograd.combine(ep, out_rows, row_primary, row_next, dst_rank, dst_row, primary_row, cu_seqlens,
                           group_rows)
    return out.to(x.dtype), counts
