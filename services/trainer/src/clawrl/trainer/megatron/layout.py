"""The shape of a Llama / Qwen2 / Qwen3 / Qwen3-MoE model as Megatron sees it, read from its HF
config, and the tensor-parallel layouts it admits (an impossible one is refused with a clear
message). The weight layout itself is mbridge's (`bridge.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Families proven on CPU against transformers (mbridge maps more; each needs its proof first).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# RoPE variants whose inverse frequencies carry the whole change (no attention scaling factor).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class LayoutError(ValueError):
    """A model or a parallel layout the Megatron backend cannot run."""


@dataclass(frozen=True)
class ModelShape:
    """What the layout checks and the GPTModel builder need to know about a model."""

    model_type: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qk_norm: bool
    # Mixture of experts (0 experts: a dense MLP everywhere).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LayoutError(
                f"model_type {model_type!r} is not supported by the Megatron backend "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if getattr(config, "mlp_bias", False):
            raise LayoutError(
                "mlp_bias=True is not supported (Megatron adds biases to all linears)"
            )
        # Qwen2 always has q/k/v biases; Llama's / Qwen3's attention_bias also biases o_proj.
        if model_type != "qwen2" and getattr(config, "attention_bias", False):
            raise LayoutError(f"{model_type} with attention_bias=True is not supported")
        if getattr(config, "use_sliding_window", False):
            raise LayoutError("sliding-window attention is not supported")
        moe = _moe_fields(config) if model_type == "qwen3_moe" else {}
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            model_type=model_type,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **moe,
        )


def _moe_fields(config: Any) -> dict[str, Any]:
    """Qwen3-MoE's experts; layouts the local spec cannot express are refused."""
    if getattr(config, "mlp_only_layers", None):
        raise LayoutError(
            f"mlp_only_layers={config.mlp_only_layers} is not supported (every layer must be MoE)"
        )
    if getattr(config, "decoder_sparse_step", 1) != 1:
        raise LayoutError(
            f"decoder_sparse_step={config.decoder_sparse_step} is not supported "
            "(every layer must be MoE)"
        )
    return {
        "num_experts": config.num_experts,
        "experts_per_token": config.num_experts_per_tok,
        "moe_ffn_hidden_size": config.moe_intermediate_size,
        "norm_topk_prob": bool(config.norm_topk_prob),
    }


def check_tensor_parallel(shape: ModelShape, tp: int, sequence_parallel: bool = True) -> None:
    """Refuse a TP size that does not split the model's heads and MLP evenly, and MoE at TP > 1
    without sequence parallelism."""
    if tp < 1:
        raise LayoutError(f"tensor parallel size must be >= 1, got {tp}")
    problems = []
    if shape.num_heads % tp:
        problems.append(f"num_attention_heads={shape.num_heads} is not divisible by it")
    kv = shape.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} neither divides nor is divisible by it")
    if shape.num_experts and tp > 1 and not sequence_parallel:
        # megatron-core 0.16.1's MoELayer.forward raises in training at TP > 1 without it
        problems.append(
            "a mixture-of-experts model at TP > 1 needs sequence parallelism (megatron-core "
            "refuses MoE with tensor parallelism without it): set megatron.sequence_parallel=true"
        )
    if shape.num_experts:
        if shape.moe_ffn_hidden_size % tp:
            problems.append(
                f"moe_intermediate_size={shape.moe_ffn_hidden_size} is not divisible by it"
            )
    elif shape.ffn_hidden_size % tp:
        problems.append(f"intermediate_size={shape.ffn_hidden_size} is not divisible by it")
    if problems:
        raise LayoutError(
            f"tensor parallel size {tp} is impossible for this {shape.model_type} model: "
            + "; ".join(problems)
        )


def rope_parameters(config: Any) -> dict[str, Any]:
    """rope_theta and the scaling fields, from transformers 5's `rope_parameters` or older ones'
    `rope_theta` + `rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = {"rope_theta": config.rope_theta, **(getattr(config, "rope_scaling", None) or {})}
    return params


def rope_inv_freq(config: Any, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them: [head_dim // 2]."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise LayoutError(
            f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise LayoutError("partial rotary embeddings are not supported")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if rope_type == "default":
        return inv_freq
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if attention_factor != 1.0:
        raise LayoutError(f"rope_type {rope_type!r} with attention scaling is not supported")
    return inv_freq.float()
