"""The mbridge adapter without processes: local-spec names translated to the names mbridge maps,
the config switches set over mbridge's, and one model's tied embeddings not leaking into the next
bridge built in the process (mbridge edits a mapping its classes share)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from clawrl.trainer.megatron.bridge import (
    RMSNorm,
    local_block_spec,
    make_bridge,
    mbridge_name,
    runtime_overrides,
)
from clawrl.trainer.megatron.layout import ModelShape
from tests.conftest import free_port
from tests.unit.megatron.tiny import tiny_configs


@pytest.mark.parametrize(
    ("local", "moe", "expected"),
    [
        ("decoder.layers.3.input_layernorm.weight", False,
         "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"),
        ("decoder.layers.3.pre_mlp_layernorm.weight", False,
         "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"),
        ("decoder.layers.3.pre_mlp_layernorm.weight", True,
         "decoder.layers.3.pre_mlp_layernorm.weight"),
        ("decoder.layers.1.mlp.experts.local_experts.12.linear_fc1.weight", True,
         "decoder.layers.1.mlp.experts.linear_fc1.weight12"),
        ("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", True,
         "decoder.layers.1.mlp.experts.linear_fc2.weight0"),
        ("decoder.layers.0.self_attention.linear_qkv.weight", False,
         "decoder.layers.0.self_attention.linear_qkv.weight"),
    ],
)  # fmt: skip
def test_local_spec_names_become_mbridge_names(local, moe, expected):
    assert mbridge_name(local, moe) == expected


def test_overrides_switch_off_what_the_local_spec_cannot_run():
    dense = runtime_overrides(ModelShape.from_hf_config(tiny_configs()["llama"]), on_gpu=False)
    assert dense["sequence_parallel"] is False and dense["hidden_dropout"] == 0.0
    assert dense["use_cpu_initialization"] is True and "moe_grouped_gemm" not in dense
    moe = runtime_overrides(ModelShape.from_hf_config(tiny_configs()["qwen3_moe"]), on_gpu=True)
    assert moe["moe_grouped_gemm"] is False and moe["moe_token_dispatcher_type"] == "allgather"
    assert moe["moe_router_pre_softmax"] is False  # norm_topk_prob=True: top-k, then softmax
    assert runtime_overrides(ModelShape.from_hf_config(tiny_configs()["llama"]), False, True)[
        "sequence_parallel"
    ]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_every_norm_of_the_local_spec_allows_sequence_parallelism(family):
    # megatron-core's torch norm asserts sequence parallelism is off: none may be left
    spec = repr(local_block_spec(ModelShape.from_hf_config(tiny_configs()[family]), 2))
    assert "WrappedTorchNorm" not in spec and "bridge.RMSNorm" in spec
    norm = RMSNorm(type("Config", (), {"sequence_parallel": True}), 8, eps=1e-6)
    assert norm.weight.sequence_parallel and norm.eps == 1e-6  # its grads get all-reduced


@pytest.fixture
def parallel_state():
    from megatron.core import parallel_state as ps

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_a_tied_model_does_not_tie_the_next_untied_one(parallel_state):
    configs = tiny_configs()
    tied = configs["qwen3"]  # tie_word_embeddings=True
    untied = type(tied)(**{**tied.to_dict(), "tie_word_embeddings": False})
    for config, source in ((tied, "model.embed_tokens.weight"), (untied, "lm_head.weight")):
        bridge = make_bridge(config, ModelShape.from_hf_config(config), 1, torch.float32, False)
        assert bridge._weight_name_mapping_mcore_to_hf("output_layer.weight") == [source]
