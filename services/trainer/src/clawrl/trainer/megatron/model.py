"""Megatron-core GPTModel built from an HF config (local layer spec: the same modules on CPU and
GPU, no Transformer Engine), loaded from and exported to HF tensors on one TP rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from clawrl.trainer.megatron.layout import ModelShape, rope_inv_freq
from clawrl.trainer.megatron.mapping import Tensors, hf_to_megatron, parameter_rules


def transformer_config(shape: ModelShape, tp: int, dtype: torch.dtype, on_gpu: bool):
    """Megatron's TransformerConfig for `shape`; CUDA-only fusions off on CPU."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        # RL fine-tuning: no dropout, so TP ranks and the HF model compute the same function.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )


def build_gpt_model(hf_config: Any, tp: int, dtype: torch.dtype, device: torch.device):
    """An (untrained) GPTModel for this rank's TP slice, with HF's exact RoPE frequencies."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    shape = ModelShape.from_hf_config(hf_config)
    config = transformer_config(shape, tp, dtype, on_gpu=device.type == "cuda")
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm"),
        vocab_size=shape.padded_vocab(tp),
        max_sequence_length=shape.max_positions,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
    )
    # transformers' frequencies (default / linear / llama3 scaling) replace Megatron's own.
    model.rotary_pos_emb.inv_freq = rope_inv_freq(hf_config, shape.head_dim).to(device)
    return model.to(device)


def load_hf_weights(model: torch.nn.Module, hf: Tensors, shape: ModelShape, rank: int, tp: int):
    """Copy this rank's slices of the HF tensors into the model (every parameter, exactly once)."""
    wanted = hf_to_megatron(hf, shape, rank, tp)
    params = dict(model.named_parameters())
    missing, unexpected = set(params) - set(wanted), set(wanted) - set(params)
    if missing or unexpected:
        raise KeyError(
            f"mapping mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    with torch.no_grad():
        for name, tensor in wanted.items():
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"{name}: model {tuple(params[name].shape)} vs {tuple(tensor.shape)}"
                )
            params[name].copy_(tensor)
    mark_tensor_parallel(model, shape, tp)


def mark_tensor_parallel(model: torch.nn.Module, shape: ModelShape, tp: int) -> None:
    """Set Megatron's TP attributes on every parameter. Megatron sets them only while
    initialising weights, which is skipped (they are loaded); its grad norm and optimizer read
    them to count a sharded parameter on every rank and a replicated one once."""
    rules = parameter_rules(shape, tp)
    for name, param in model.named_parameters():
        dim = rules[name].partition_dim
        param.tensor_model_parallel = dim is not None
        param.partition_dim = -1 if dim is None else dim
        param.partition_stride = 1
