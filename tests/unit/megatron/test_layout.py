"""Layouts the Megatron backend refuses (with the reason), the 4/2/2 node plan, RoPE frequencies
equal to transformers', and the settings that choose the backend."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig, Qwen2Config

from clawrl.common.models import SMOLLM2, resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.trainer.megatron.actors import check_layout, rank_config
from clawrl.trainer.megatron.layout import (
    LayoutError,
    ModelShape,
    check_tensor_parallel,
    rope_inv_freq,
)
from clawrl.trainer.megatron.placement import plan_node
from clawrl.trainer.megatron.settings import MegatronSettings
from clawrl.trainer.settings import RaySettings, TrainerSettings, TrainSettings
from tests.unit.megatron.tiny import COMMON, tiny_configs


def test_smollm2_135m_heads_refuse_tp2_and_accept_tp3():
    # SmolLM2-135M: 9 heads, 3 KV heads
    heads = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
             "intermediate_size": 1536}  # fmt: skip
    shape = ModelShape.from_hf_config(LlamaConfig(**{**COMMON, **heads}))
    with pytest.raises(LayoutError, match="num_attention_heads=9 is not divisible"):
        check_tensor_parallel(shape, 2)
    check_tensor_parallel(shape, 3)
    # more ranks than KV heads (4 heads, 2 KV heads at TP=4): Megatron shares a KV head (GPU)
    check_tensor_parallel(ModelShape.from_hf_config(tiny_configs()["llama"]), 4)


def test_tp_not_matching_kv_heads_nor_ffn_is_refused():
    shape = ModelShape.from_hf_config(LlamaConfig(**{**COMMON, "num_attention_heads": 12,
                                      "num_key_value_heads": 4, "hidden_size": 48}))  # fmt: skip
    with pytest.raises(LayoutError, match="num_key_value_heads=4 neither divides"):
        check_tensor_parallel(shape, 6)
    with pytest.raises(LayoutError, match="intermediate_size=48 is not divisible"):
        check_tensor_parallel(ModelShape.from_hf_config(tiny_configs()["llama"]), 32)


def test_unsupported_models_are_refused_by_name():
    with pytest.raises(LayoutError, match="model_type 'gpt2'"):
        ModelShape.from_hf_config(type("C", (), {"model_type": "gpt2"})())
    with pytest.raises(LayoutError, match="attention_bias=True"):
        ModelShape.from_hf_config(LlamaConfig(attention_bias=True, **COMMON))
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    with pytest.raises(LayoutError, match="rope_type 'yarn'"):
        rope_inv_freq(Qwen2Config(rope_parameters=yarn, **COMMON), 8)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rope_frequencies_equal_transformers(family):
    from transformers import AutoModelForCausalLM

    config = tiny_configs()[family]
    model = AutoModelForCausalLM.from_config(config)
    expected = model.model.rotary_emb.inv_freq
    assert torch.allclose(
        rope_inv_freq(config, ModelShape.from_hf_config(config).head_dim), expected
    )


def test_the_default_node_plan_is_4_2_2():
    plan = plan_node()
    assert plan.trainer_tp == 4
    assert plan.trainer_bundles == ({"CPU": 4.0, "GPU": 1.0},) * 4
    assert plan.trainer_strategy == "STRICT_PACK"
    assert (plan.policy.replicas, plan.policy.tp) == (1, 2)
    assert (plan.judge.replicas, plan.judge.tp) == (1, 2)
    assert plan.gpus == 8


def test_impossible_node_plans_are_refused():
    with pytest.raises(LayoutError, match="TP 3 does not divide its 4 GPUs"):
        plan_node(actor_tp=3)
    with pytest.raises(LayoutError, match="data parallelism"):
        plan_node(actor_tp=2)
    with pytest.raises(LayoutError, match="exceed the node's 8"):
        plan_node(rollout_gpus=4)
    with pytest.raises(LayoutError, match="policy engines: TP 4 does not divide its 2"):
        plan_node(rollout_tp=4)


def test_settings_refuse_tp_that_does_not_use_the_trainer_gpus():
    assert MegatronSettings(tensor_parallel_size=4, trainer_gpus=4).tensor_parallel_size == 4
    with pytest.raises(ValidationError, match="does not divide trainer_gpus=4"):
        MegatronSettings(tensor_parallel_size=3, trainer_gpus=4)
    with pytest.raises(ValidationError, match="data parallelism"):
        MegatronSettings(tensor_parallel_size=2, trainer_gpus=4)


def test_backend_is_chosen_by_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("CLAWRL_TRAIN__BACKEND", "megatron")
    monkeypatch.setenv("CLAWRL_MEGATRON__TENSOR_PARALLEL_SIZE", "2")
    settings = TrainerSettings()
    assert settings.train.backend == "megatron"
    assert rank_config(settings).tp == 2
    assert (rank_config(settings).device, rank_config(settings).dtype) == ("cpu", "float32")


def test_device_and_ray_gpus_must_agree():
    gpu = TrainerSettings(ray=RaySettings(actor_num_gpus=1))
    assert (rank_config(gpu).device, rank_config(gpu).dtype) == ("cuda", "bfloat16")
    with pytest.raises(LayoutError, match=r"needs ray\.actor_num_gpus"):
        rank_config(TrainerSettings(train=TrainSettings(device="cuda")))


def test_start_up_check_refuses_tp2_for_smollm2_135m():
    settings = TrainerSettings(megatron=MegatronSettings(tensor_parallel_size=2))
    model_dir = resolve_model_dir(ModelSettings(path=SMOLLM2))
    with pytest.raises(LayoutError, match="tensor parallel size 2 is impossible"):
        check_layout(settings, model_dir)


def test_start_up_check_reads_sequence_parallel_from_the_settings(tmp_path):
    tiny_configs()["qwen3_moe"].save_pretrained(tmp_path)
    check_layout(TrainerSettings(megatron=MegatronSettings(tensor_parallel_size=2)), tmp_path)
    no_sp = MegatronSettings(tensor_parallel_size=2, sequence_parallel=False)
    with pytest.raises(LayoutError, match="needs sequence parallelism"):
        check_layout(TrainerSettings(megatron=no_sp), tmp_path)
    # more ranks than KV heads (4 heads, 2 KV heads) runs on CPU too
    check_layout(TrainerSettings(megatron=MegatronSettings(tensor_parallel_size=4)), tmp_path)


def test_moe_layouts_that_cannot_run_are_refused_with_the_reason():
    from transformers import Qwen3MoeConfig

    from tests.unit.megatron.tiny import MOE

    shape = ModelShape.from_hf_config(tiny_configs()["qwen3_moe"])
    assert (shape.num_experts, shape.experts_per_token, shape.moe_ffn_hidden_size) == (4, 2, 16)
    check_tensor_parallel(shape, 1)
    check_tensor_parallel(shape, 2)  # sequence parallel (the default)
    with pytest.raises(LayoutError, match=r"at TP > 1 needs sequence parallelism"):
        check_tensor_parallel(shape, 2, sequence_parallel=False)
    with pytest.raises(LayoutError, match=r"mlp_only_layers=\[1\] is not supported"):
        ModelShape.from_hf_config(Qwen3MoeConfig(mlp_only_layers=[1], **MOE, **COMMON))
    with pytest.raises(LayoutError, match="decoder_sparse_step=2 is not supported"):
        ModelShape.from_hf_config(Qwen3MoeConfig(decoder_sparse_step=2, **MOE, **COMMON))
