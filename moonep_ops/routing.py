"""The router's top-k choice, shared by MoELayer and the dense reference."""

from __future__ import annotations

import torch


def route(logits: torch.Tensor, K: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, E] -> (route weights fp32 [S, K], expert ids int64 [S, K]): softmax, top-k, and the
    top-k weights renormalised to sum to one when `normalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, K, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids
