"""HF <-> Megatron name/shape mapping: round trips, TP shard shapes, GQA interleaving, SwiGLU."""

from __future__ import annotations

import pytest
import torch

from clawrl.trainer.megatron.layout import ModelShape
from clawrl.trainer.megatron.mapping import hf_to_megatron, megatron_to_hf, parameter_rules
from tests.unit.megatron.tiny import tiny_configs, tiny_hf_tensors

CONFIGS = tiny_configs()


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_gives_back_identical_tensors(family, tp):
    config = CONFIGS[family]
    hf = tiny_hf_tensors(family)
    shape = ModelShape.from_hf_config(config)
    shards = [hf_to_megatron(hf, shape, rank, tp) for rank in range(tp)]
    back = megatron_to_hf(shards, shape)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_hf_tensor_is_used_exactly_once(family):
    config = CONFIGS[family]
    hf = tiny_hf_tensors(family)
    rules = parameter_rules(ModelShape.from_hf_config(config), tp=2)
    used = [name for rule in rules.values() for name in vars(rule).values() if name in hf]
    assert sorted(used) == sorted(hf)


def test_tp2_shard_shapes_follow_megatron_partitioning():
    config = CONFIGS["qwen2"]  # vocab 101 -> padded to 102
    shape = ModelShape.from_hf_config(config)
    hf = tiny_hf_tensors("qwen2")
    shard = hf_to_megatron(hf, shape, rank=1, tp=2)
    h, d = 32, 8
    assert shard["embedding.word_embeddings.weight"].shape == (51, h)
    assert shard["output_layer.weight"].shape == (51, h)
    # rank 1's last vocab row is padding
    assert torch.equal(shard["output_layer.weight"][-1], torch.zeros(h))
    qkv_rows = (4 + 2 * 2) * d // 2
    assert shard["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (qkv_rows, h)
    assert shard["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (qkv_rows,)
    assert shard["decoder.layers.0.self_attention.linear_proj.weight"].shape == (h, 4 * d // 2)
    assert shard["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 48 // 2, h)
    assert shard["decoder.layers.0.mlp.linear_fc2.weight"].shape == (h, 48 // 2)
    assert shard["decoder.final_layernorm.weight"].shape == (h,)


def test_qkv_rows_are_interleaved_per_gqa_group_and_each_rank_gets_its_groups():
    config = CONFIGS["llama"]  # 4 heads, 2 groups, head_dim 8
    shape = ModelShape.from_hf_config(config)
    hf = tiny_hf_tensors("llama")
    attn = "model.layers.1.self_attn."
    q, k, v = (hf[attn + f"{p}_proj.weight"] for p in "qkv")
    for rank in range(2):  # TP=2: one group per rank
        fused = hf_to_megatron(hf, shape, rank, 2)[
            "decoder.layers.1.self_attention.linear_qkv.weight"
        ]
        expected = torch.cat(
            [q[rank * 16 : rank * 16 + 16], k[rank * 8 : rank * 8 + 8], v[rank * 8 : rank * 8 + 8]]
        )
        assert torch.equal(fused, expected)


def test_gate_up_fused_per_rank():
    config = CONFIGS["qwen3"]
    shape = ModelShape.from_hf_config(config)
    hf = tiny_hf_tensors("qwen3")
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    fc1 = hf_to_megatron(hf, shape, rank=1, tp=2)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[24:], up[24:]]))


def test_tied_embeddings_have_no_output_layer():
    shape = ModelShape.from_hf_config(CONFIGS["qwen3"])
    assert "output_layer.weight" not in parameter_rules(shape, 1)
    assert "output_layer.weight" in parameter_rules(ModelShape.from_hf_config(CONFIGS["llama"]), 1)
