"""Tiny random configs of each supported family (built from config by transformers: no download)."""

from __future__ import annotations

from functools import cache

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

COMMON = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}


def tiny_configs() -> dict[str, object]:
    """One config per family, each exercising a different feature: Llama with llama3 RoPE
    scaling and untied embeddings, Qwen2 with qkv biases and a vocabulary TP=2 must pad, Qwen3
    with QK-norm, an explicit head_dim and tied embeddings, Qwen3-MoE with 4 experts (top 2,
    renormalised as the released models do, and not) in every layer."""
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return {
        "llama": LlamaConfig(vocab_size=100, rope_parameters=llama3_rope, **COMMON),
        "qwen2": Qwen2Config(vocab_size=101, tie_word_embeddings=False, **COMMON),
        "qwen3": Qwen3Config(vocab_size=100, head_dim=8, tie_word_embeddings=True, **COMMON),
        "qwen3_moe": Qwen3MoeConfig(vocab_size=100, head_dim=8, **MOE, **COMMON),
        # the router's other form: softmax over all experts, top-k kept as they are
        "qwen3_moe_unnormalised": Qwen3MoeConfig(
            vocab_size=100, head_dim=8, **{**MOE, "norm_topk_prob": False}, **COMMON
        ),
    }


@cache
def tiny_hf_tensors(family: str) -> dict[str, torch.Tensor]:
    """The (cached) tensors of a random model of `family`; callers must not modify them."""
    return hf_tensors(random_hf_model(tiny_configs()[family]))


def random_hf_model(config, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised fp32 HF model; norms get random weights too so a mix-up shows."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
    return model


def hf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF state dict as saved (no lm_head when embeddings are tied)."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state
