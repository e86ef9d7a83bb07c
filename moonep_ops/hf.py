"""Hugging Face transformers 5.x drop-in: swap the sparse-MoE blocks of a model for expert-parallel ones.

    ep = EPGroup(EPConfig(S=batch*seq, H=cfg.hidden_size, K=cfg.num_experts_per_tok, E=n_experts,
                          F=moe_intermediate_size, R=world), dtype=model.dtype)
    swap_moe_blocks(model, ep)        # every rank, same model, in place: this rank keeps its E/R experts
    loss = model(input_ids, labels=labels).loss          # this rank's own tokens
    loss.backward()
    allreduce_dense_grads(model, ep.group)               # the data-parallel rule, below

Supported (model_type -> sparse block): qwen3_moe (Qwen3MoeSparseMoeBlock), qwen2_moe
(Qwen2MoeSparseMoeBlock, gated shared expert), mixtral (MixtralSparseMoeBlock, router jitter),
deepseek_v3 (DeepseekV3MoE: sigmoid group-limited router, ungated shared experts). The swapped block
(`HFMoEBlock`) takes and returns [batch, seq, H] like HF's (in 5.x none of the four returns a tuple),
routes with the router the config implies (moonep_ops/routers.py), and its router module is hooked
into HF's output recorder, so `output_router_logits=True` and the aux loss work unchanged.

Checkpoints: the swapped block's state_dict keys and layouts are HF's own: `experts.gate_up_proj`
[E, 2F, H] (gate rows first) and `experts.down_proj` [E, H, F] (ours: `w_gate`/`w_up` [E/R, H, F],
`w_down` [E/R, F, H]), `gate.weight`, `gate.e_score_correction_bias`, `shared_expert.*` /
`shared_expert_gate.weight`, `shared_experts.*`. Saving holds the FULL experts tensors: `state_dict()`
all-gathers this rank's experts over the EP group (a collective: every rank calls it at the same
point; each gets the full tensor, on the experts' device), so a checkpoint saved from any rank loads
into the untouched HF model and into a swapped model at any R. Loading takes HF's full tensors and
copies this rank's slice [rank*E/R, (rank+1)*E/R) into the experts in place (symmetric memory stays).

Data-parallel rule for gradients. Under expert parallelism every rank runs the model on its own
tokens. An expert's gradient is complete after backward: the combine/dispatch backward brings it the
gradients of every rank's tokens routed to it (sum_r d loss_r / dW). Every other parameter (the
router, the shared experts, attention, norms, embeddings) only saw this rank's tokens, so it must be
all-reduced over the data-parallel group, which under pure EP is the EP group itself.
`allreduce_dense_grads(model, group)` does it: reduction="mean" gives every parameter the gradient of
mean_r loss_r (dense grads averaged, expert grads divided by R), reduction="sum" the gradient of
sum_r loss_r (dense grads summed, expert grads untouched). With EP inside a larger data-parallel world
(several EP groups), the experts also need an all-reduce over their replicas: not covered here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .functional import moe_experts
from .group import EPGroup
from .layers import MoEExperts
from .routers import LOGITS_INDEX, DeepSeekV3Router, Router, SoftmaxTopKRouter
from .shared import SharedExperts


@dataclass(frozen=True)
class _ModelSpec:
    block: str         # the HF sparse block class, "module:Class"
    n_experts: str     # config field: routed experts
    ffn: str           # config field: an expert's intermediate size
    shared: str | None  # attribute name of the shared experts in HF's block, if any


_SPECS = {
    "qwen3_moe": _ModelSpec("transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeSparseMoeBlock",
                            "num_experts", "moe_intermediate_size", None),
    "qwen2_moe": _ModelSpec("transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeSparseMoeBlock",
                            "num_experts", "moe_intermediate_size", "shared_expert"),
    "mixtral": _ModelSpec("transformers.models.mixtral.modeling_mixtral:MixtralSparseMoeBlock",
                          "num_local_experts", "intermediate_size", None),
    "deepseek_v3": _ModelSpec("transformers.models.deepseek_v3.modeling_deepseek_v3:DeepseekV3MoE",
                              "n_routed_experts", "moe_intermediate_size", "shared_experts"),
}
# Qwen2-MoE's sigmoid gate of the shared expert: a sibling in HF's block, a child of SharedExperts here
_SHARED_GATE_KEYS = ("shared_expert.gate.weight", "shared_expert_gate.weight")
_EXPERT_KEYS = ("experts.w_gate", "experts.w_up", "experts.w_down")
_HF_EXPERT_KEYS = ("experts.gate_up_proj", "experts.down_proj")


def _spec(config) -> _ModelSpec:
    model_type = getattr(config, "model_type", None)
    if model_type not in _SPECS:
        raise ValueError(f"swap_moe_blocks: model_type={model_type!r} is not supported "
                         f"(supported: {', '.join(sorted(_SPECS))})")
    return _SPECS[model_type]


def _field(config, name: str):
    if not hasattr(config, name):
        raise ValueError(f"swap_moe_blocks: {config.model_type} config has no field {name!r}")
    return getattr(config, name)


def _check_config(config, ep: EPGroup) -> None:
    spec, c = _spec(config), ep.cfg
    if _field(config, "hidden_act") != "silu":
        raise ValueError(f"swap_moe_blocks: {config.model_type} config.hidden_act={config.hidden_act!r}: "
                         f"the experts are SwiGLU with silu only")
    want = (("hidden_size", c.H, "H"), (spec.n_experts, c.E, "E"), ("num_experts_per_tok", c.K, "K"),
            (spec.ffn, c.F, "F"))
    for field, have, cfg_name in want:
        if _field(config, field) != have:
            raise ValueError(f"swap_moe_blocks: {config.model_type} config.{field}={getattr(config, field)} but "
                             f"EPConfig.{cfg_name}={have}")
    if config.model_type == "deepseek_v3" and _field(config, "n_shared_experts") < 1:
        raise ValueError(f"swap_moe_blocks: deepseek_v3 config.n_shared_experts={config.n_shared_experts} must be >= 1")


def _router(config, dtype: torch.dtype, device: torch.device) -> Router:
    H, K, E = config.hidden_size, config.num_experts_per_tok, getattr(config, _spec(config).n_experts)
    if config.model_type == "deepseek_v3":
        return DeepSeekV3Router(H, E, K, n_group=_field(config, "n_group"), topk_group=_field(config, "topk_group"),
                                routed_scaling_factor=_field(config, "routed_scaling_factor"),
                                norm_topk_prob=_field(config, "norm_topk_prob"), device=device)
    if config.model_type == "mixtral":
        return SoftmaxTopKRouter(H, E, K, normalize=True, jitter_noise=_field(config, "router_jitter_noise"),
                                 dtype=dtype, device=device)
    return SoftmaxTopKRouter(H, E, K, normalize=_field(config, "norm_topk_prob"), dtype=dtype, device=device)


def _shared(config, dtype: torch.dtype, device: torch.device) -> SharedExperts | None:
    if config.model_type == "qwen2_moe":
        return SharedExperts(config.hidden_size, _field(config, "shared_expert_intermediate_size"), gated=True,
                             dtype=dtype, device=device)
    if config.model_type == "deepseek_v3":
        return SharedExperts(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                             dtype=dtype, device=device)
    return None


def _gather_experts(ep: EPGroup, w: torch.Tensor) -> torch.Tensor:
    """This rank's [E/R, ...] -> every rank's, concatenated in rank order: [E, ...] (collective)."""
    w = w.detach().contiguous()
    if ep.cfg.R == 1:
        return w.clone()
    parts = [torch.empty_like(w) for _ in range(ep.cfg.R)]
    dist.all_gather(parts, w, group=ep.group)
    return torch.cat(parts)


class HFMoEBlock(nn.Module):
    """An HF sparse-MoE block on expert parallelism: router (`gate`) -> `moe_experts` over this rank's
    `experts` (+ shared experts). [batch, seq, H] -> [batch, seq, H]; batch*seq must be EPConfig.S.
    state_dict in HF's layout (module docstring)."""

    def __init__(self, config, ep: EPGroup, dtype: torch.dtype, hf_class_name: str):
        """dtype: of the router (DeepSeek-V3's is fp32 always, as in HF) and the shared experts."""
        super().__init__()
        _check_config(config, ep)
        self.ep = ep
        self.model_type = config.model_type
        self.hf_class_name = hf_class_name
        self.gate = _router(config, dtype, ep.device)
        self.experts = MoEExperts(ep)
        shared = _shared(config, dtype, ep.device)
        self.shared_name = _spec(config).shared
        if shared is not None:
            self.add_module(self.shared_name, shared)
        self.register_state_dict_post_hook(_save_hf_layout)
        self.register_load_state_dict_pre_hook(_load_hf_layout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        H = self.ep.cfg.H
        if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
            raise TypeError(f"{self.hf_class_name} (moonep): hidden_states must be a floating tensor "
                            f"[batch, seq, H={H}], got {getattr(hidden_states, 'dtype', type(hidden_states).__name__)}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != H:
            raise ValueError(f"{self.hf_class_name} (moonep): hidden_states must have hidden size H={H} in its "
                             f"last dimension, got shape {tuple(hidden_states.shape)}")
        x = self.gate.prepare_input(hidden_states)
        tokens = x.reshape(-1, H)
        weights, ids, _ = self.gate(tokens)
        out, _ = moe_experts(self.ep, self.experts, tokens, ids, weights)
        if self.shared_name is not None:
            out = out + getattr(self, self.shared_name)(tokens)
        return out.view(hidden_states.shape)

    def extra_repr(self) -> str:
        c = self.ep.cfg
        return f"{self.hf_class_name}, rank {self.ep.rank}/{c.R}: experts [{self.ep.rank * c.epn}, {(self.ep.rank + 1) * c.epn})"


def _save_hf_layout(block: HFMoEBlock, state_dict: dict, prefix: str, local_metadata) -> None:
    """Our keys -> HF's: the experts all-gathered over the EP group, the shared gate renamed."""
    w_gate, w_up, w_down = (_gather_experts(block.ep, state_dict.pop(prefix + k)) for k in _EXPERT_KEYS)
    state_dict[prefix + _HF_EXPERT_KEYS[0]] = torch.cat([w_gate.transpose(1, 2), w_up.transpose(1, 2)], 1).contiguous()
    state_dict[prefix + _HF_EXPERT_KEYS[1]] = w_down.transpose(1, 2).contiguous()
    ours, theirs = (prefix + k for k in _SHARED_GATE_KEYS)
    if ours in state_dict:
        state_dict[theirs] = state_dict.pop(ours)


def _load_hf_layout(block: HFMoEBlock, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                    unexpected_keys, error_msgs) -> None:
    """HF's keys -> ours: this rank's slice of the full experts tensors (checked shapes)."""
    c, rank = block.ep.cfg, block.ep.rank
    mine = slice(rank * c.epn, (rank + 1) * c.epn)
    shapes = {_HF_EXPERT_KEYS[0]: (c.E, 2 * c.F, c.H), _HF_EXPERT_KEYS[1]: (c.E, c.H, c.F)}
    for key, shape in shapes.items():
        t = state_dict.get(prefix + key)
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{block.hf_class_name} (moonep): checkpoint {prefix + key} must be {list(shape)} "
                             f"(E, {'2F, H' if key.endswith('gate_up_proj') else 'H, F'}), got {list(t.shape)}")
    gate_up = state_dict.pop(prefix + _HF_EXPERT_KEYS[0], None)
    if gate_up is not None:
        state_dict[prefix + _EXPERT_KEYS[0]] = gate_up[mine, :c.F].transpose(1, 2)
        state_dict[prefix + _EXPERT_KEYS[1]] = gate_up[mine, c.F:].transpose(1, 2)
    down = state_dict.pop(prefix + _HF_EXPERT_KEYS[1], None)
    if down is not None:
        state_dict[prefix + _EXPERT_KEYS[2]] = down[mine].transpose(1, 2)
    ours, theirs = (prefix + k for k in _SHARED_GATE_KEYS)
    if theirs in state_dict:
        state_dict[ours] = state_dict.pop(theirs)


def _block_class(spec: _ModelSpec) -> type:
    module, name = spec.block.split(":")
    return getattr(importlib.import_module(module), name)


def _record_router_logits(router: Router) -> None:
    """Hook the router into HF's output recorder (what `output_router_logits=True` collects). HF hooks
    its own router classes lazily; ours is not one of them, so this is its only hook."""
    from transformers.utils.output_capturing import install_output_capuring_hook

    install_output_capuring_hook(router, "router_logits", LOGITS_INDEX)


def swap_moe_blocks(model: nn.Module, ep: EPGroup) -> list[str]:
    """Replace, in place, every sparse-MoE block of a transformers Qwen3-MoE / Qwen2-MoE / Mixtral /
    DeepSeek-V3 model by an `HFMoEBlock` with the same weights (this rank's experts); returns the
    swapped modules' names. Collective in spirit: every rank swaps the same model. The blocks' experts
    must already be in ep.dtype on ep.device (build the EPGroup with the model's dtype)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"swap_moe_blocks: model must be a transformers PreTrainedModel (with .config), "
                         f"got {type(model).__name__}")
    spec = _spec(config)
    _check_config(config, ep)
    block_cls = _block_class(spec)
    targets = [(name, m) for name, m in model.named_modules() if type(m) is block_cls]
    if not targets:
        raise ValueError(f"swap_moe_blocks: the {config.model_type} model holds no {block_cls.__name__} "
                         f"(already swapped?)")
    records_router_logits = any("router_logits" in (getattr(m, "_can_record_outputs", None) or {})
                                for m in model.modules())
    for name, hf_block in targets:
        w = hf_block.experts.gate_up_proj
        if w.dtype != ep.dtype or w.device != ep.device:
            raise ValueError(f"swap_moe_blocks: {name}.experts are {w.dtype} on {w.device} but the EPGroup computes "
                             f"in dtype={ep.dtype} on {ep.device}: build the EPGroup with dtype={w.dtype}, "
                             f"device={w.device}")
        block = HFMoEBlock(config, ep, w.dtype, block_cls.__name__)
        block.load_state_dict(hf_block.state_dict())
        block.train(hf_block.training)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, block)
        if records_router_logits:
            _record_router_logits(block.gate)
    return [name for name, _ in targets]


def allreduce_dense_grads(model: nn.Module, group: dist.ProcessGroup | None = None, reduction: str = "mean") -> None:
    """The data-parallel step of an EP model (module docstring): all-reduce the gradient of every
    parameter outside the MoEExperts over `group` (the EP group on pure EP); reduction="mean" also
    divides the experts' (already complete) gradients by the group size, so that every parameter holds
    the gradient of the ranks' mean loss; "sum": the gradient of their summed loss. Collective; call
    after backward on every rank (parameters without a gradient are skipped: the same on every rank
    when every rank runs the same model)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"allreduce_dense_grads: reduction must be 'mean' or 'sum', got {reduction!r}")
    world = dist.get_world_size(group)
    expert_ids = {id(p) for m in model.modules() if isinstance(m, MoEExperts) for p in m.parameters()}
    dense: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) in expert_ids:
            if reduction == "mean":
                p.grad.div_(world)
        else:
            dense.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in dense.values():  # one all-reduce per dtype/device bucket
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if reduction == "mean":
            flat.div_(world)
        for g, v in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(v.view_as(g))
