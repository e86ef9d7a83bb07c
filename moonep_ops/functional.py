"""The routed-experts step as a public function: any router's top-k -> plan -> dispatch -> experts ->
combine. `MoELayer` is this function behind a router module; a model with its own router (or the
Hugging Face adapter, moonep_ops/hf.py) calls it directly.

`precompile`: a fresh process's first step needs ~15 CUDA kernels (plan, dispatch, the grouped GEMMs
forward and backward, combine), each compiled when its op first runs, ~33 s one after another on an
H200 at the DESIGN shape. `precompile` runs the step's host code once with no kernel launched
(csrc_cute/jit.py, `dry_run`), which names every kernel the step would compile, then compiles them side
by side in this process and child processes (`compile_ahead`) into the kernel disk cache, which the
real step loads from. `moe_experts` does it by itself on its first eager call per EP group and kind of
step; a process that finds its kernels on disk pays only the dry run (milliseconds of host time)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from csrc_cute import jit

from . import autograd
from .group import EPGroup
from .planning import ABSENT


def _check_args(ep: EPGroup, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                at_capacity: bool) -> None:
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
    s = x.shape[0]
    if at_capacity and s != c.S:
        raise ValueError(f"moe_experts: with n_tokens, x must hold the capacity EPConfig.S={c.S} tokens, got {s}")
    if s > c.S:
        raise ValueError(f"moe_experts: x holds {s} tokens, more than the capacity EPConfig.S={c.S}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise TypeError(f"moe_experts: topk_ids must be an integer tensor (expert ids), got {topk_ids.dtype}")
    if tuple(topk_ids.shape) != (s, c.K):
        raise ValueError(f"moe_experts: topk_ids must be [s={s}, K={c.K}], got shape {tuple(topk_ids.shape)}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"moe_experts: topk_weights must be a floating tensor, got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != (s, c.K):
        raise ValueError(f"moe_experts: topk_weights must be [s={s}, K={c.K}], got shape "
                         f"{tuple(topk_weights.shape)}")


def _token_count(n_tokens: torch.Tensor | int, S: int, device: torch.device) -> torch.Tensor | int:
    """moe_experts' n_tokens, checked: an int in [0, S], or an integer tensor [1] on the tokens' device
    (its value is read on the device only; values past S count as S, below 0 as 0)."""
    if isinstance(n_tokens, torch.Tensor):
        if n_tokens.dtype not in (torch.int32, torch.int64) or n_tokens.shape != (1,) or n_tokens.device != device:
            raise ValueError(f"moe_experts: n_tokens must be an int32/int64 tensor [1] on {device}, got "
                             f"{n_tokens.dtype} {list(n_tokens.shape)} on {n_tokens.device}")
        return n_tokens
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 0 <= n_tokens <= S:
        raise ValueError(f"moe_experts: n_tokens must be in [0, EPConfig.S={S}], got {n_tokens!r}")
    return n_tokens


def moe_experts(ep: EPGroup, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                n_tokens: torch.Tensor | int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k topk_weights[s, k] * expert_{topk_ids[s, k]}(x[s]) over the EP group: (out [s, H] in x's
    dtype, counts [R, E] int32, every rank's tokens per expert).

    x [s, H]: this rank's s <= EPConfig.S tokens (any float dtype: computed in ep.dtype; S is the static
    capacity of the group's buffers, and ranks may pass different s). The tokens are padded to S inside;
    pad rows are absent (expert ids -1: neither sent nor computed), so with N routed rows over all ranks
    rank d computes N // R + (1 if d < N % R else 0) rows. topk_ids [s, K] integer in [0, E) (the plan op
    rejects others); topk_weights [s, K] (computed in fp32; differentiable, like x and the experts'
    weights). `experts` is this rank's `MoEExperts`.
    n_tokens: x holds the capacity [S, H] and only its first n_tokens rows are present, an int32 tensor
    [1] on x's device (read on the device: no recompile and no host sync when it changes, so decode
    steps replay one CUDA graph) or a Python int; output rows >= n_tokens are zero.
    Collective: every rank of the EP group calls it once per layer.
    """
    _check_args(ep, experts, x, topk_ids, topk_weights, at_capacity=n_tokens is not None)
    _precompile_once(ep, experts, x, topk_ids, topk_weights)
    c = ep.cfg
    s = x.shape[0]
    # an eager full batch needs no pad in and no slice out: each is a copy of x's size, and autograd runs a
    # twin of each in backward (~0.2 ms of a DESIGN-shape step on an H200). Under torch.compile the one
    # padded graph serves every s (Dynamo sees s == S as a guard on a dynamic s: a recompile at s = S)
    full = not torch.compiler.is_compiling() and s == c.S
    tokens, route_w, ids = x.to(ep.dtype), topk_weights.float(), topk_ids
    if n_tokens is None and not full:
        pad = c.S - s  # symbolic under torch.compile(dynamic=True): a new s does not recompile
        tokens = F.pad(tokens, (0, 0, 0, pad))
        route_w = F.pad(route_w, (0, 0, 0, pad))
        ids = F.pad(ids, (0, 0, 0, pad), value=ABSENT)
    elif n_tokens is not None:
        present = (torch.arange(c.S, device=x.device) < _token_count(n_tokens, c.S, x.device))[:, None]
        ids = torch.where(present, ids, ABSENT)
        route_w = torch.where(present, route_w, 0.0)
    plan = autograd.plan(ep, ids.contiguous())
    # R = 1: the rows are the tokens by index, which the gathered GEMMs read in place (EPGroup(gather_rows))
    dispatch = autograd.dispatch_index if ep.gather_rows else autograd.dispatch
    dispatched = dispatch(ep, tokens.contiguous(), route_w.contiguous(), plan)
    out = experts(dispatched, plan, combine=True)  # experts -> combine: one Function (autograd.experts_combine)
    return (out if full else out[:s]).to(x.dtype), plan.counts


_PRECOMPILED: set[tuple[str, bool, torch.dtype]] = set()  # (EPGroup key, train, ids dtype)


def precompile(ep: EPGroup, experts, train: bool = True, ids_dtype: torch.dtype = torch.int64,
               workers: int | None = None) -> list[jit.CompileCall]:
    """Compile (into the kernel disk cache) every CUDA kernel that a step of `moe_experts(ep, experts,
    ...)` runs: forward and backward when `train`, else the inference forward; `ids_dtype` is the top-k
    ids' dtype. `workers`: processes compiling at once (default `csrc_cute.jit.compile_workers()`).
    Returns the compile calls that were missing (none when every kernel was on disk; always none on the
    CPU, which runs the reference ops). The dry run launches nothing and waits for no peer; every rank
    of a group compiles the same kernels, and the disk cache's locks share the work out."""
    if ep.device.type != "cuda":
        return []
    with jit.dry_run() as calls:
        _dry_step(ep, experts, train, ids_dtype)
    jit.compile_ahead(calls, workers)
    _PRECOMPILED.add((ep.key, train, ids_dtype))
    return calls


def _precompile_once(ep: EPGroup, experts, x: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> None:
    """`precompile` at the first eager call of each kind (training or not, the ids' dtype) on a CUDA
    group; not while torch.compile traces (checked first: nothing here enters a graph) or a CUDA graph
    captures, not inside a dry run, and not with the disk cache off (no child could hand a kernel back)."""
    if torch.compiler.is_compiling() or ep.device.type != "cuda":
        return
    # what the experts' Function decides too: it keeps pre-activations only for a backward to come
    train = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, *experts.parameters()))
    if ((ep.key, train, topk_ids.dtype) in _PRECOMPILED or jit.dry_running()
            or torch.cuda.is_current_stream_capturing() or jit.cache_root() is None):
        return
    try:
        precompile(ep, experts, train, topk_ids.dtype)
    except Exception as exc:  # noqa: BLE001 - only a speed-up: the step itself still runs (and compiles)
        # e.g. a step inside a context that refuses a nested autograd.grad (activation checkpointing)
        _PRECOMPILED.add((ep.key, train, topk_ids.dtype))
        warnings.warn(f"moe_experts: compiling the step's kernels ahead failed ({type(exc).__name__}: {exc}); "
                      "each compiles when its op first runs (call moonep_ops.precompile before the step to "
                      "see the error)", stacklevel=3)


def _dry_step(ep: EPGroup, experts, train: bool, ids_dtype: torch.dtype) -> None:
    """One `moe_experts` step at the group's capacity on zero inputs: forward, and backward when `train`
    (gradients through autograd.grad, so no parameter's .grad is touched)."""
    c = ep.cfg
    with torch.enable_grad() if train else torch.no_grad():
        x = torch.zeros(c.S, c.H, dtype=ep.dtype, device=ep.device, requires_grad=train)
        weights = torch.zeros(c.S, c.K, dtype=torch.float32, device=ep.device, requires_grad=train)
        ids = torch.zeros(c.S, c.K, dtype=ids_dtype, device=ep.device)
        out, _ = moe_experts(ep, experts, x, ids, weights)
        if train:
            params = [p for p in experts.parameters() if p.requires_grad]
            torch.autograd.grad(out, [x, weights, *params], torch.zeros_like(out))
