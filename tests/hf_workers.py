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
