"""Synthetic skewed routings for benchmarks and tests.

Expert popularity is lognormal (one draw per expert, shared by all ranks through the seed); every rank
samples each token's K experts without replacement in proportion to popularity (Gumbel top-k). A
bisection on the lognormal sigma hits a target maxvio = max_e(T_e / mean_T) - 1. `ForcedRouter` makes a
router's top-K pick given experts (exact routing), `Routings` holds the per-maxvio ids of every rank and layer.
"""

from __future__ import annotations

import torch
from torch import nn

BIAS_TOP, BIAS_STEP = 64.0, 0.5  # forced logits of a token's K experts: 64, 63.5, ..., others 0


def sample_topk(R: int, S: int, E: int, K: int, sigma: float, seed: int = 0, device: str = "cpu",
                replacement: bool = False) -> list[torch.Tensor]:
    """Top-k expert ids [S, K] (int64, on `device`) of each of the R ranks.

    Without replacement (what a router's top-k gives): Gumbel top-k. With replacement (a token may
    name an expert twice; K may exceed E): K independent draws.
    """
    g = torch.Generator().manual_seed(seed)
    log_pop = (torch.randn(E, generator=g, dtype=torch.float64) * sigma).to(device)
    gd = torch.Generator(device=device).manual_seed(seed + 1)
    out = []
    for _ in range(R):
        if replacement:
            probs = torch.softmax(log_pop, 0).expand(S, E).contiguous()  # multinomial misreads expanded rows
            out.append(torch.multinomial(probs, K, replacement=True, generator=gd))
            continue
        u = torch.rand(S, E, generator=gd, dtype=torch.float64, device=device).clamp_(1e-12, 1 - 1e-12)
        gumbel = -torch.log(-torch.log(u))
        out.append(torch.topk(log_pop + gumbel, K, dim=1).indices)
    return out


def counts_of(ids: list[torch.Tensor], E: int) -> torch.Tensor:
    """int32 [R, E] token counts of each rank's ids."""
    return torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids]).int()


def realized_maxvio(ids: list[torch.Tensor], E: int) -> float:
    tot = counts_of(ids, E).sum(0).double()
    return float(tot.max() / tot.mean() - 1)


def routing_for_maxvio(R: int, S: int, E: int, K: int, target: float, seed: int = 0, iters: int = 40
                       ) -> tuple[list[torch.Tensor], float, float]:
    """(ids per rank, sigma, realized maxvio) with realized maxvio close to `target`.

    With K distinct experts per token an expert gets at most one row per token, so maxvio <= E/K - 1.
    """
    if target > E / K - 1:
        raise ValueError(f"target maxvio {target} is above E/K - 1 = {E / K - 1:.2f}, the most K distinct "
                         f"experts per token allow")
    lo, hi = 0.0, 1.0
    while realized_maxvio(sample_topk(R, S, E, K, hi, seed), E) < target and hi < 64:
        lo, hi = hi, hi * 2
    for _ in range(iters):
        mid = (lo + hi) / 2
        if realized_maxvio(sample_topk(R, S, E, K, mid, seed), E) < target:
            lo = mid
        else:
            hi = mid
    ids = sample_topk(R, S, E, K, hi, seed)
    return ids, hi, realized_maxvio(ids, E)


class ForcedRouter(nn.Module):
    """The layer's router Linear plus a fixed logit bias [S, E] that makes top-K pick given experts."""

    def __init__(self, linear: nn.Linear, S: int):
        super().__init__()
        self.linear = linear
        self.register_buffer("bias", torch.zeros(S, linear.out_features, dtype=torch.float32,
                                                 device=linear.weight.device))

    def set_ids(self, ids: torch.Tensor) -> None:
        """ids [S, K]: token s's top-K will be ids[s] (in this order)."""
        K = ids.shape[1]
        top = BIAS_TOP - BIAS_STEP * torch.arange(K, dtype=torch.float32, device=self.bias.device)
        with torch.no_grad():
            self.bias.zero_().scatter_(1, ids.to(self.bias.device), top.expand(ids.shape).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).float() + self.bias


class Routings:
    """Per target maxvio: ids of every rank for `n_layers` layers. Layer 0 is routing_for_maxvio's draw;
    layer i > 0 relabels its expert ids with a fixed random permutation (the same on every rank): the same
    maxvio, other hot experts on other home ranks."""

    def __init__(self, R: int, S: int, E: int, K: int, targets: list[float], n_layers: int, seed: int):
        self.by_target = {}
        perms = [torch.arange(E)] + [torch.randperm(E, generator=torch.Generator().manual_seed(seed + 1000 * i))
                                     for i in range(1, n_layers)]
        for t in targets:
            ids0, _, _ = routing_for_maxvio(R, S, E, K, t, seed=seed)
            self.by_target[t] = [[p[ids] for ids in ids0] for p in perms]
