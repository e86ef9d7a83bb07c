"""Router modules: tokens [s, H] -> RouterOutput(weights fp32 [s, K], ids int64 [s, K], logits [s, E]).

One interface for every router, so `MoELayer`, `moe_experts` and the Hugging Face adapter
(moonep_ops/hf.py) take any of them: `forward(x)` returns the route weights the experts' outputs are
scaled by, the chosen experts, and the raw logits (what an auxiliary load-balancing loss reads).
`prepare_input(x)` is the block input the router and the experts both see (identity except for
Mixtral's training-time jitter, which multiplies the whole block input in Hugging Face's model).

Each router reproduces one Hugging Face transformers 5.x routing exactly (the same ops in the same
order, fp32 where the HF model computes in fp32), except that the weights are returned in fp32 where
HF rounds them to the logits' dtype (identical for fp32 models):
  SoftmaxTopKRouter   softmax -> top-k (-> renormalise): Qwen3-MoE, Qwen2-MoE (`norm_topk_prob`),
                      Mixtral (always renormalised; `jitter_noise` = `router_jitter_noise`)
  TopKSoftmaxRouter   top-k of the logits -> softmax over the K chosen
  DeepSeekV3Router    sigmoid scores, `e_score_correction_bias` for the choice only, group-limited
                      top-k (`n_group` groups scored by their two best experts, `topk_group` kept),
                      weights = the chosen scores (-> renormalise) * `routed_scaling_factor`
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .routing import route


class RouterOutput(NamedTuple):
    weights: torch.Tensor  # fp32 [s, K]: route weight of each chosen expert
    ids: torch.Tensor      # int64 [s, K]: the chosen experts, in [0, E)
    logits: torch.Tensor   # [s, E]: the router's raw scores (aux loss input)


LOGITS_INDEX = RouterOutput._fields.index("logits")


class Router(nn.Module):
    """Base of the routers: a linear gate `weight` [E, H] (no bias), top-k of E experts."""

    def __init__(self, H: int, E: int, K: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        for name, v in (("H", H), ("E", E), ("K", K)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be an int >= 1, got {v!r}")
        if K > E:
            raise ValueError(f"{type(self).__name__}: K={K} must be <= E={E}")
        self.H, self.E, self.K = H, E, K
        self.weight = nn.Parameter(torch.empty(E, H, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=H ** -0.5)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """The block input the router and the experts see (identity for routers without jitter)."""
        return x

    def check_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, H] (or [..., H]) floating -> [s, H]."""
        name = type(self).__name__
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name}: x must be a floating tensor [s, H={self.H}], got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() < 1 or x.shape[-1] != self.H:
            raise ValueError(f"{name}: x must have hidden size H={self.H} in its last dimension, "
                             f"got shape {tuple(x.shape)}")
        return x.reshape(-1, self.H)

    def extra_repr(self) -> str:
        return f"H={self.H}, E={self.E}, K={self.K}"


class SoftmaxTopKRouter(Router):
    """softmax over the E logits (fp32) -> top-k -> renormalised to sum 1 when `normalize`.

    Qwen3-MoE / Qwen2-MoE: normalize = `norm_topk_prob`; Mixtral: normalize = True and
    jitter_noise = `router_jitter_noise` (in training the block input is multiplied by
    U(1 - jitter, 1 + jitter), drawn like Mixtral's `torch.empty_like(x).uniform_`)."""

    def __init__(self, H: int, E: int, K: int, normalize: bool = True, jitter_noise: float = 0.0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__(H, E, K, dtype, device)
        if not 0.0 <= jitter_noise < 1.0:
            raise ValueError(f"SoftmaxTopKRouter: jitter_noise must be in [0, 1), got {jitter_noise}")
        self.normalize = bool(normalize)
        self.jitter_noise = float(jitter_noise)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_noise > 0:
            return x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        return x

    def forward(self, x: torch.Tensor) -> RouterOutput:
        logits = F.linear(self.check_input(x), self.weight)
        weights, ids = route(logits, self.K, self.normalize)
        return RouterOutput(weights, ids, logits)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, normalize={self.normalize}, jitter_noise={self.jitter_noise}"


class TopKSoftmaxRouter(Router):
    """top-k of the E logits -> softmax over the K chosen logits (fp32); the weights sum to 1."""

    def forward(self, x: torch.Tensor) -> RouterOutput:
        logits = F.linear(self.check_input(x), self.weight)
        top, ids = torch.topk(logits, self.K, dim=-1)
        return RouterOutput(torch.softmax(top.float(), dim=-1), ids, logits)


class DeepSeekV3Router(Router):
    """DeepSeek-V3: fp32 logits, scores = sigmoid(logits); the choice uses scores +
    `e_score_correction_bias` (a buffer, trained outside autograd), limited to the `topk_group` best of
    `n_group` expert groups (a group's score: the sum of its two best experts); the weights are the
    chosen experts' unbiased scores, renormalised (+1e-20) when `norm_topk_prob`, times
    `routed_scaling_factor`. The gate weight is fp32 whatever the model's dtype, as in HF."""

    def __init__(self, H: int, E: int, K: int, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True,
                 device: torch.device | str | None = None):
        super().__init__(H, E, K, torch.float32, device)
        if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or E % n_group:
            raise ValueError(f"DeepSeekV3Router: n_group must be an int >= 1 dividing E={E}, got {n_group!r}")
        if E // n_group < 2:
            raise ValueError(f"DeepSeekV3Router: every group needs >= 2 experts (a group scores its two best), "
                             f"got E={E}, n_group={n_group}")
        if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
            raise ValueError(f"DeepSeekV3Router: topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
        if topk_group * (E // n_group) < K:
            raise ValueError(f"DeepSeekV3Router: topk_group={topk_group} groups of {E // n_group} experts "
                             f"hold fewer than K={K} experts")
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.norm_topk_prob = bool(norm_topk_prob)
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> RouterOutput:
        tokens = self.check_input(x)
        logits = F.linear(tokens.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.E // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.E)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.K, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return RouterOutput(weights * self.routed_scaling_factor, ids, logits)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, n_group={self.n_group}, topk_group={self.topk_group}, "
                f"routed_scaling_factor={self.routed_scaling_factor}, norm_topk_prob={self.norm_topk_prob}")
