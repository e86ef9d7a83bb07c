"""Per-rank bodies of the Hugging Face adapter tests (tests/test_hf.py): tiny random transformers 5.x
causal LMs, their untouched copy as the reference, the same model with moonep's blocks swapped in."""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded: configs are built here

import torch
import torch.distributed as dist

from moonep_ops import EPConfig, EPGroup
from moonep_ops.hf import allreduce_dense_grads, swap_moe_blocks

H, F, E, K, LAYERS, VOCAB, SEQ = 32, 16, 8, 2, 2, 64, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts_per_tok=K, max_position_embeddings=64,
              tie_word_embeddings=False, use_cache=False, attn_implementation="eager")
MODELS = ("qwen3_moe", "qwen3_moe_unnormalised", "qwen2_moe", "mixtral", "deepseek_v3")


def hf_config(name: str):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if name.startswith("qwen3_moe"):
        return Qwen3MoeConfig(**COMMON, num_experts=E, moe_intermediate_size=F, intermediate_size=48,
                              norm_topk_prob=name == "qwen3_moe")
    if name == "qwen2_moe":
        return Qwen2MoeConfig(**COMMON, num_experts=E, moe_intermediate_size=F, intermediate_size=48,
                              shared_expert_intermediate_size=24, norm_topk_prob=False)
    if name == "mixtral":
        return MixtralConfig(**COMMON, num_local_experts=E, intermediate_size=F)
    if name == "deepseek_v3":
        kw = {k: v for k, v in COMMON.items() if k != "head_dim"} | dict(num_key_value_heads=4)  # MLA: no GQA
        return DeepseekV3Config(**kw, n_routed_experts=E, moe_intermediate_size=F, intermediate_size=48,
                                n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                norm_topk_prob=True, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    raise ValueError(name)


def hf_model(name: str, seed: int = 0):
    """The reference causal LM (fp32, eval: no jitter/dropout), random weights the same on every rank;
    DeepSeek's correction bias made non-zero so that it matters."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name)).eval()
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(seed + 7)) * 0.1)
    return model


def ep_config(R: int, batch: int = 1) -> EPConfig:
    return EPConfig(S=batch * SEQ, H=H, K=K, E=E, F=F, R=R, P=16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max().clamp_min(1e-30))


def _as_ours(ref_grads: dict, rank: int, R: int) -> dict:
    """The reference's gradients in the swapped model's names and layouts (experts: this rank's slice)."""
    epn = E // R
    mine = slice(rank * epn, (rank + 1) * epn)
    out = {}
    for name, g in ref_grads.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            out[base + "w_gate"] = g[mine, :F].transpose(1, 2)
            out[base + "w_up"] = g[mine, F:].transpose(1, 2)
        elif name.endswith("experts.down_proj"):
            out[name[: -len("down_proj")] + "w_down"] = g[mine].transpose(1, 2)
        elif name.endswith("shared_expert_gate.weight"):
            out[name.replace("shared_expert_gate.weight", "shared_expert.gate.weight")] = g
        else:
            out[name] = g
    return out


def _batches(R: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (R, SEQ), generator=torch.Generator().manual_seed(seed))


def lm_against_hf(rank: int, R: int, names: tuple[str, ...], export: bool) -> dict:
    """Per model: max relative errors of the swapped LM against the untouched HF LM (this rank's tokens
    are row `rank` of a batch of R sequences; the reference runs the whole batch, so its loss is the
    ranks' mean loss and its gradients those of the mean: ours after allreduce_dense_grads('mean')),
    HF's aux loss and router logits on this rank's tokens, and the checkpoint round trip."""
    ep = EPGroup(ep_config(R))
    out = {}
    for name in names:
        ref = hf_model(name)
        model = copy.deepcopy(ref)
        swap_moe_blocks(model, ep)
        ids_all = _batches(R)
        ids = ids_all[rank:rank + 1]
        res = {}
        # forward + backward: logits, loss, every parameter's gradient
        ref_out = ref(ids_all, labels=ids_all)
        ref_out.loss.backward()
        ours = model(ids, labels=ids)
        ours.loss.backward()
        allreduce_dense_grads(model, ep.group)
        mean_loss = ours.loss.detach().clone()
        dist.all_reduce(mean_loss, group=ep.group)
        res["logits"] = _rel(ours.logits, ref_out.logits[rank:rank + 1])
        res["loss"] = _rel(mean_loss / R, ref_out.loss)
        want = _as_ours({n: p.grad for n, p in ref.named_parameters()}, rank, R)
        got = {n: p.grad for n, p in model.named_parameters()}
        res["grad_names_match"] = set(want) == set(got) and all(g is not None for g in got.values())
        res["grads"] = max(_rel(got[n], want[n]) for n in want)
        # HF's aux loss and router logits, on this rank's tokens
        with torch.no_grad():
            ref_aux = ref(ids, labels=ids, output_router_logits=True)
            our_aux = model(ids, labels=ids, output_router_logits=True)
        # (a transformers version whose LM records no router logits, DeepSeek-V3's before 5.2x, has none)
        our_logits, ref_logits = (getattr(o, "router_logits", None) for o in (our_aux, ref_aux))
        res["n_router_logits"] = tuple(None if lg is None else len(lg) for lg in (our_logits, ref_logits))
        res["router_logits"] = max((_rel(a, b) for a, b in zip(our_logits or (), ref_logits or ())), default=0.0)
        ref_aux_loss = getattr(ref_aux, "aux_loss", None)
        res["aux_loss"] = None if ref_aux_loss is None else _rel(our_aux.aux_loss, ref_aux_loss)
        res["aux_total_loss"] = _rel(our_aux.loss, ref_aux.loss)
        if export:  # torch.export of the swapped LM (use_cache off) against eager
            with torch.no_grad():
                prog = torch.export.export(model, (ids,), kwargs=dict(use_cache=False), strict=False)
                res["export"] = _rel(prog.module()(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
        # checkpoint round trip: HF checkpoint (another seed) -> swapped -> HF layout, and into a fresh HF LM
        other = hf_model(name, seed=1)
        other_sd = other.state_dict()
        model.load_state_dict(other_sd)
        saved = model.state_dict()  # collective: gathers the experts
        res["save_keys_match"] = set(saved) == set(other_sd)
        res["save_exact"] = res["save_keys_match"] and all(torch.equal(saved[k], other_sd[k]) for k in other_sd)
        ref.load_state_dict(saved)  # the untouched LM (done with as the reference) takes the saved checkpoint
        res["reload_exact"] = all(torch.equal(v, other_sd[k]) for k, v in ref.state_dict().items())
        with torch.no_grad():
            res["loaded_logits"] = _rel(model(ids).logits, other(ids).logits)
        out[name] = res
    return out


def generate_against_hf(R: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """8 greedy new tokens of the swapped Qwen3-MoE LM and of the untouched one (same prompt on every
    rank; decoding steps feed s = 1 < S tokens per rank)."""
    ref = hf_model("qwen3_moe")
    model = copy.deepcopy(ref)
    swap_moe_blocks(model, EPGroup(ep_config(R)))
    prompt = _batches(1)
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        return model.generate(prompt, **kw), ref.generate(prompt, **kw)
