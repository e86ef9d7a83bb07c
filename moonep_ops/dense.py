"""A single-process dense MoE with the same math as MoELayer: the reference for EP runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .routing import route


def dense_moe(x: torch.Tensor, router_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
              w_down: torch.Tensor, K: int, normalize_topk: bool = True, ids: torch.Tensor | None = None
              ) -> torch.Tensor:
    """x [N, H]; router_w [E, H]; w_gate, w_up [E, H, F]; w_down [E, F, H] -> [N, H].

    out[n] = sum_k w[n, k] * (silu(x W_gate[e]) * (x W_up[e])) W_down[e], e = ids[n, k]; differentiable.
    `ids` [N, K] fixes the experts (e.g. to those a bf16 run chose where fp32 logits would pick another
    of two near-equal experts); the weights are still the softmax of these logits at those ids.
    """
    logits = x @ router_w.t()
    if ids is None:
        weights, ids = route(logits, K, normalize_topk)
    else:
        weights = torch.softmax(logits.float(), dim=-1).gather(1, ids)
        if normalize_topk:
            weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(router_w.shape[0]):
        n, k = torch.nonzero(ids == e, as_tuple=True)
        if n.numel() == 0:
            continue
        xe = x[n].float()
        y = (F.silu(xe @ w_gate[e].float()) * (xe @ w_up[e].float())) @ w_down[e].float()
        out = out.index_add(0, n, y * weights[n, k][:, None])
    return out.to(x.dtype)
