"""nn.Modules: the SwiGLU experts of one rank and the drop-in MoE FFN block."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from . import autograd
from .functional import moe_experts
from .group import EPGroup
from .handles import Dispatch, Plan
from .routers import Router, RouterOutput
from .routing import route


def tokens_of(cfg, x: torch.Tensor, at_capacity: bool = False) -> torch.Tensor:
    """MoELayer's input x [..., H] -> its tokens [s, H], after the checks of that form: a floating-point
    tensor whose last dimension is H, holding s <= EPConfig.S tokens (S is the capacity of the EP
    group's buffers), or exactly S with `at_capacity` (the n_tokens form). `moe_experts` checks its own
    [s, H] input the same way, for callers that route themselves (moonep_ops/functional.py)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"MoELayer: x must be a Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"MoELayer: x must have a floating-point dtype (it is cast to the group's dtype and "
                         f"back), got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != cfg.H:
        raise ValueError(f"MoELayer: x must be [..., H] with H={cfg.H} (EPConfig.H), got shape {list(x.shape)}")
    n = x.numel() // cfg.H
    if at_capacity and n != cfg.S:
        raise ValueError(f"MoELayer: with n_tokens, x must hold the capacity EPConfig.S={cfg.S} tokens of size "
                         f"H={cfg.H}, got {n}")
    if n > cfg.S:
        raise ValueError(f"MoELayer: x holds {n} tokens of size H={cfg.H}, more than the capacity "
                         f"EPConfig.S={cfg.S}")
    return x.reshape(n, cfg.H)


class MoEExperts(nn.Module):
    """This rank's home experts, SwiGLU: y = (silu(x W_gate) * (x W_up)) W_down, times the route weight.

    Weights: w_gate, w_up [epn, H, F]; w_down [epn, F, H]. Experts e = rank*epn + i for i in [0, epn).
    With B < epn (inference) peers read them remotely, so on CUDA they live in symmetric memory: load
    a checkpoint in place (`load_state_dict`, `copy_`), never by replacing the tensors.
    """

    def __init__(self, ep: EPGroup, dtype: torch.dtype | None = None):
        super().__init__()
        c = ep.cfg
        self.ep = ep
        ep.alloc_weight_buffers()
        dtype = dtype or ep.dtype
        if c.B < c.epn:
            def weight(*shape):
                return ep.home_weight(*shape, dtype=dtype)
        else:
            def weight(*shape):
                return torch.empty(*shape, dtype=dtype, device=ep.device)
        self.w_gate = nn.Parameter(weight(c.epn, c.H, c.F))
        self.w_up = nn.Parameter(weight(c.epn, c.H, c.F))
        self.w_down = nn.Parameter(weight(c.epn, c.F, c.H))
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        """`.to()`, `.half()`, `.cuda()`... of a model holding these experts. Their tensors are tied to the
        EPGroup (its slot pools, receive buffers and, with B < epn on CUDA, symmetric home weights are
        fixed), so: a device change is refused; a dtype change leaves the experts in the group's dtype
        (with a warning naming it) while the rest of the model converts: the routed path casts the
        tokens to the group's dtype and its output back to the input's."""
        probe = fn(torch.empty(0, dtype=self.w_gate.dtype, device=self.w_gate.device))
        if probe.device != self.w_gate.device:
            raise RuntimeError(
                f"MoEExperts: cannot move the experts to {probe.device}: they belong to an EPGroup on "
                f"{self.ep.device} (dtype={self.ep.dtype}) whose buffers are fixed; build the EPGroup on the "
                f"device you want and the layers on it")
        if probe.dtype != self.w_gate.dtype:
            warnings.warn(f"MoEExperts: the experts stay in the EPGroup's dtype={self.ep.dtype} (requested "
                          f"{probe.dtype}); tokens are cast to it and the output back. For {probe.dtype} "
                          f"experts build the EPGroup with dtype={probe.dtype}", stacklevel=2)
            return self
        return super()._apply(fn, recurse)

    def reset_parameters(self) -> None:
        c = self.ep.cfg
        for w, fan_in in ((self.w_gate, c.H), (self.w_up, c.H), (self.w_down, c.F)):
            nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, dispatched: Dispatch, plan: Plan, combine: bool = False) -> torch.Tensor:
        """The dispatched rows [NvS, H], grouped by plan.cu_seqlens (home experts, slots, remote reads) ->
        their outputs [NvS, H] times their route weights (dispatched.row_w); with `combine`, those outputs
        combined into the token rows [S, H] in the same autograd Function (what `moe_experts` runs: its
        backward holds one [NvS, H] less, autograd.experts_combine)."""
        if combine:
            return autograd.experts_combine(self.ep, self.w_gate, self.w_up, self.w_down, plan, dispatched)
        if dispatched.rows is None:
            raise ValueError("MoEExperts: dispatched holds no rows (the gathered form of autograd.dispatch_index, "
                             "EPGroup(gather_rows=True) at R = 1): run the experts with combine=True, or dispatch "
                             "the rows with autograd.dispatch")
        return autograd.experts_ffn(self.ep, dispatched.rows, dispatched.row_w, self.w_gate, self.w_up, self.w_down,
                                    plan)


class MoELayer(nn.Module):
    """Drop-in MoE FFN block: router -> plan -> dispatch -> prefetch -> grouped GEMMs -> combine
    (`moe_experts`), plus the optional shared experts on every token.

    Input and output: [s, H] (or any [..., H]) with s <= S tokens on this rank; S = EPConfig.S is the
    static capacity of the buffers, and ranks may pass different s in the same step. The tokens are
    padded to S inside (pad rows are absent: expert ids -1, neither sent nor computed). With N routed
    rows over all ranks, rank d computes exactly N // R + (1 if d < N % R else 0) rows whatever the
    router does.
    `layer(x_full, n_tokens=t)`: x_full holds the capacity [S, H] (or [..., H] with S tokens) and only
    its first t rows are present; t is an int32 tensor [1] on x's device (read on the device: no
    recompile and no host sync when it changes, so decode steps replay one CUDA graph) or a Python
    int. Output rows >= t are zero (the routed part: shared experts still add theirs).
    router: a `moonep_ops.routers.Router` (forward -> RouterOutput(weights, ids, logits)), or any module
        returning logits [s, E], routed by softmax -> top-k (-> renormalised when `normalize_topk`);
        default: nn.Linear(H, E) with that routing. The last eager forward's logits stay in
        `router_logits` (the auxiliary load-balancing loss reads them).
    shared_experts: a module [s, H] -> [s, H] added to the routed output (e.g. `SharedExperts`).
    """

    def __init__(self, ep: EPGroup, normalize_topk: bool = True, dtype: torch.dtype | None = None,
                 router: nn.Module | None = None, shared_experts: nn.Module | None = None):
        super().__init__()
        c = ep.cfg
        self.ep = ep
        self.normalize_topk = normalize_topk
        self.router = router if router is not None else nn.Linear(c.H, c.E, bias=False, dtype=dtype or ep.dtype,
                                                                  device=ep.device)
        self.experts = MoEExperts(ep, dtype)
        self.shared_experts = shared_experts
        self.last_counts: torch.Tensor | None = None  # [R, E] token counts of the last eager forward
        self.router_logits: torch.Tensor | None = None  # [S, E] of the last eager forward

    def forward(self, x: torch.Tensor, n_tokens: torch.Tensor | int | None = None) -> torch.Tensor:
        c = self.ep.cfg
        tokens = tokens_of(c, x, at_capacity=n_tokens is not None)
        if isinstance(self.router, Router):
            tokens = self.router.prepare_input(tokens)
        routed = self.router(tokens)
        if isinstance(routed, RouterOutput):
            route_w, ids, logits = routed
        else:
            logits = routed
            route_w, ids = route(logits, c.K, self.normalize_topk)
        out, counts = moe_experts(self.ep, self.experts, tokens, ids, route_w, n_tokens)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if not torch.compiler.is_compiling():
            self.last_counts = counts
            self.router_logits = logits
        return out.view(x.shape)


class MoEBlock(nn.Module):
    """A transformer-like residual block without attention: x + mix(norm(x)), then x + MoE(norm(x)).
    `mix` is a dense token-wise projection standing in for attention (same on every rank)."""

    def __init__(self, ep: EPGroup, dtype: torch.dtype | None = None):
        super().__init__()
        c = ep.cfg
        dtype = dtype or ep.dtype
        self.norm1 = nn.RMSNorm(c.H, dtype=dtype, device=ep.device)
        self.mix = nn.Linear(c.H, c.H, bias=False, dtype=dtype, device=ep.device)
        self.norm2 = nn.RMSNorm(c.H, dtype=dtype, device=ep.device)
        self.moe = MoELayer(ep, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoEModel(nn.Module):
    """`n_layers` MoE blocks sharing one EPGroup: every layer uses the same receive buffers, slot pools
    and reduce buffers (the memory of the copies does not grow with depth)."""

    def __init__(self, ep: EPGroup, n_layers: int, dtype: torch.dtype | None = None):
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"MoEModel: n_layers must be >= 1, got {n_layers}")
        self.blocks = nn.ModuleList(MoEBlock(ep, dtype) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
