"""Hugging Face <-> Megatron through `mbridge`: the model's TransformerConfig, the GPTModel, loading
HF safetensors into this rank's TP slices, and exporting full HF tensors one at a time.

mbridge knows each family's config and weight layout (fused QKV per GQA group, fused SwiGLU,
experts, tied embeddings, vocabulary padding); what this module adds is the same on CPU and GPU:

- The layer spec: mbridge builds Transformer Engine layers (`get_gpt_decoder_block_spec(...,
  use_transformer_engine=True)`), which need TE and CUDA; this backend uses megatron-core's local
  spec everywhere (torch modules; experts as `SequentialMLP`). So the bridge gets the local spec,
  and the local spec's parameter names are translated to the TE names mbridge maps (the separate
  input / pre-MLP norms, `local_experts.E.linear_fcN.weight`).
- The runtime switches mbridge sets for GPU speed (fused kernels, grouped GEMM, dropout from the HF
  config) are set to what runs on both devices and computes the HF function; sequence parallelism
  is the backend's setting (on by default at TP > 1, as mbridge has it), and the local spec's
  norms become ones that run under it (megatron-core's torch norm refuses it).
- RoPE: transformers' exact inverse frequencies (llama3 / linear scaling) replace Megatron's,
  and the interpolation factor mbridge derives from `rope_scaling` is cleared (they carry it).
- The TP attributes Megatron sets only while initialising weights (skipped: they are loaded) are
  set from the layer types, for the gradient clip, the optimizer and mbridge's export.

mbridge's own `get_model` is not used: it moves the model to CUDA and wraps it (Float16Module) on
every device (`mbridge/core/util.py: model_module.cuda(torch.cuda.current_device())`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from clawrl.trainer.megatron.layout import ModelShape, rope_inv_freq, rope_parameters

# Local-spec parameter names -> the names mbridge's mappings know (Transformer Engine's).
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def mbridge_name(local: str, moe: bool) -> str:
    """The name mbridge maps for a local-spec parameter name (pure string function)."""
    if local.endswith(".input_layernorm.weight"):
        return local.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
    if local.endswith(".pre_mlp_layernorm.weight") and not moe:
        # dense layers: TE fuses this norm into fc1; MoE layers keep it (mbridge maps both ways)
        return local.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
    match = _EXPERT.search(local)
    if match:
        expert, fc = match.groups()
        return local[: match.start()] + f".mlp.experts.{fc}.weight{expert}"
    return local


def runtime_overrides(
    shape: ModelShape, on_gpu: bool, sequence_parallel: bool = False
) -> dict[str, Any]:
    """TransformerConfig fields set over mbridge's: no dropout (TP ranks and the HF model compute
    the same function), sequence parallelism as asked (TP > 1 only), no fused / TE /
    grouped-GEMM kernels (the local spec has none), weights loaded not drawn."""
    overrides: dict[str, Any] = {
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "sequence_parallel": sequence_parallel,
        "attention_softmax_in_fp32": True,
        "use_cpu_initialization": not on_gpu,
        "perform_initialization": False,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "apply_rope_fusion": False,
    }
    if shape.num_experts:
        overrides |= {
            "moe_grouped_gemm": False,
            # HF's norm_topk_prob: top-k then softmax over the k (renormalised) is
            # Megatron's default; softmax over all experts then top-k is its pre-softmax.
            "moe_router_pre_softmax": not shape.norm_topk_prob,
            # mbridge's alltoall dispatcher opens a CUDA stream when built; expert parallel is
            # 1 here, where allgather moves the same tokens (it refuses variable lengths, which
            # only pipeline parallel needs).
            "moe_token_dispatcher_type": "allgather",
            "variable_seq_lengths": False,
        }
    return overrides


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built the way Megatron builds its norms, usable with sequence parallelism
    (megatron-core's `WrappedTorchNorm` asserts it is off; its sequence-parallel norm needs Apex).
    Under sequence parallelism each rank normalises its own part of the sequence, so the weight's
    gradient is a partial sum: the attribute tells the step (and Megatron's
    `finalize_model_grads`) to add it up over the TP group."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _with_norm(spec: Any, norm: type) -> Any:
    """A copy of a layer spec with every megatron-core torch norm replaced by `norm`."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return norm
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=_with_norm(spec.submodules, norm))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = {f.name: _with_norm(getattr(spec, f.name), norm) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **fields)
    return spec


def local_block_spec(shape: ModelShape, num_layers: int):
    """megatron-core's local (torch) GPT layer spec, every layer, and the final norm, with norms
    that run under sequence parallelism."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(
        num_experts=shape.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=shape.qk_norm,
        normalization="RMSNorm",
    )
    return TransformerBlockSubmodules(
        layer_specs=[_with_norm(layer, RMSNorm)] * num_layers, layer_norm=RMSNorm
    )


def make_bridge(
    hf_config: Any,
    shape: ModelShape,
    tp: int,
    dtype: torch.dtype,
    on_gpu: bool,
    sequence_parallel: bool = False,
):
    """mbridge's bridge for this model family, set up for the local spec (parallel state must be
    initialised: mbridge reads the TP group from it); `sequence_parallel` applies at TP > 1."""
    from mbridge import AutoBridge

    from clawrl.trainer.megatron.cpu_compat import define_missing_te_names

    define_missing_te_names()

    config = copy.deepcopy(hf_config)
    if not hasattr(config, "rope_theta"):  # transformers 5 moved it; mbridge 0.15 reads it
        config.rope_theta = float(rope_parameters(hf_config)["rope_theta"])
    bridge = AutoBridge.from_config(config, dtype=dtype, make_vocab_size_divisible_by=tp)
    # mbridge points output_layer at the embedding by editing the class's shared mapping when a
    # model ties them (Qwen2Bridge), which a later untied model in the process inherits: each
    # bridge gets its own mapping, pointed at the right tensor.
    bridge._DIRECT_MAPPING = {
        **bridge._DIRECT_MAPPING,
        "output_layer.weight": "model.embed_tokens.weight"
        if shape.tied_embeddings
        else "lm_head.weight",
    }
    bridge.set_extra_args(**runtime_overrides(shape, on_gpu, sequence_parallel and tp > 1))
    spec = local_block_spec(shape, hf_config.num_hidden_layers)
    # mbridge asks this method for the (TE) layer spec; the instance attribute answers instead.
    bridge._get_transformer_layer_spec = lambda vp_stage=None: spec
    bridge.has_vp_stage = False
    te_names = bridge._weight_name_mapping_mcore_local_to_global
    moe = bool(shape.num_experts)

    def local_to_mbridge(model, consider_ep: bool = True) -> dict[str, str]:
        names = te_names(model, consider_ep=consider_ep)
        return {local: mbridge_name(name, moe) for local, name in names.items()}

    bridge._weight_name_mapping_mcore_local_to_global = local_to_mbridge
    return bridge


def build_model(bridge, hf_config: Any, device: torch.device):
    """The GPTModel of this rank's TP slice (unloaded), with HF's exact RoPE frequencies."""
    shape = ModelShape.from_hf_config(hf_config)
    model = bridge._model_provider([])(pre_process=True, post_process=True)
    # transformers' frequencies (default / linear / llama3 scaling) replace Megatron's own; the
    # interpolation factor mbridge passes for rope_scaling would scale positions a second time.
    model.rotary_pos_emb.inv_freq = rope_inv_freq(hf_config, shape.head_dim).to(device)
    model.rotary_pos_emb.seq_len_interpolation_factor = None
    mark_tensor_parallel(model)
    return model.to(device)


def mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Megatron's TP attributes by layer type: column-parallel and vocab-parallel weights (and
    column biases) split on dim 0, row-parallel weights on dim 1, everything else replicated."""
    from megatron.core import tensor_parallel as tpl

    for module in model.modules():
        if isinstance(module, tpl.ColumnParallelLinear | tpl.VocabParallelEmbedding):
            split = {"weight": 0, "bias": 0}
        elif isinstance(module, tpl.RowParallelLinear):
            split = {"weight": 1}
        else:
            continue
        for name, dim in split.items():
            param = getattr(module, name, None)
            if isinstance(param, torch.nn.Parameter) and not hasattr(param, "partition_dim"):
                tpl.set_tensor_model_parallel_attributes(param, True, dim, 1)
    for param in model.parameters():
        tpl.set_defaults_if_not_set_tensor_model_parallel_attributes(param)


def load_hf_dir(bridge, model: torch.nn.Module, model_dir: Path) -> None:
    """Every parameter of this rank from the HF safetensors of `model_dir` (TP rank 0 reads,
    mbridge scatters the slices over the TP group; a name it cannot map raises)."""
    with torch.no_grad():
        bridge.load_weights([model], str(model_dir))


def export_hf(bridge, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The full HF tensors, one at a time (every TP rank must iterate: each is all-gathered)."""
    with torch.no_grad():
        for name, tensor in bridge.export_weights([model]):
            yield name, tensor.detach()
