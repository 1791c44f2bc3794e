"""The shape of a Llama / Qwen2 / Qwen3 model as Megatron sees it, read from its HF config, and the
tensor-parallel layouts it admits (an impossible one is refused with a clear message)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# RoPE variants whose inverse frequencies carry the whole change (no attention scaling factor).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class LayoutError(ValueError):
    """A model or a parallel layout the Megatron backend cannot run."""


@dataclass(frozen=True)
class ModelShape:
    """What the HF <-> Megatron mapping and the GPTModel builder need to know about a model."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    norm_eps: float
    max_positions: int

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
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            norm_eps=float(config.rms_norm_eps),
            max_positions=config.max_position_embeddings,
        )

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows after padding so each TP rank holds an equal slice."""
        return math.ceil(self.vocab_size / tp) * tp


def check_tensor_parallel(shape: ModelShape, tp: int) -> None:
    """Refuse a TP size that does not split the model's heads and MLP evenly."""
    if tp < 1:
        raise LayoutError(f"tensor parallel size must be >= 1, got {tp}")
    problems = []
    if shape.num_heads % tp:
        problems.append(f"num_attention_heads={shape.num_heads} is not divisible by it")
    kv = shape.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} neither divides nor is divisible by it")
    if shape.ffn_hidden_size % tp:
        problems.append(f"intermediate_size={shape.ffn_hidden_size} is not divisible by it")
    if problems:
        raise LayoutError(
            f"tensor parallel size {tp} is impossible for this {shape.model_type} model: "
            + "; ".join(problems)
        )


def rope_inv_freq(config: Any, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them: [head_dim // 2]."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers < 5: rope_theta + rope_scaling
        params = {"rope_theta": config.rope_theta, **(getattr(config, "rope_scaling", None) or {})}
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
