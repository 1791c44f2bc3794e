"""HF <-> Megatron parameter mapping with tensor-parallel sharding (pure tensor functions).

Megatron (local layer spec) fuses q/k/v into one column-parallel `linear_qkv` whose rows are
interleaved per GQA group -- [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...] -- and
split into equal contiguous TP slices, and fuses SwiGLU's gate and up into `linear_fc1` where
each TP rank holds [its gate slice; its up slice]. Row-parallel weights (o_proj, down_proj) are
split along the input dimension; the vocabulary is padded to a multiple of TP and split by rows;
norms are replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from clawrl.trainer.megatron.layout import ModelShape

Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Replicated:
    """Same tensor on every rank."""

    hf: str
    partition_dim = None

    def shard(self, hf: Tensors, rank: int, tp: int) -> torch.Tensor:
        return hf[self.hf]

    def gather(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.hf: shards[0]}


@dataclass(frozen=True)
class Split:
    """Equal contiguous slices along `dim` (row-parallel inputs: dim=1)."""

    hf: str
    dim: int

    @property
    def partition_dim(self) -> int:
        return self.dim

    def shard(self, hf: Tensors, rank: int, tp: int) -> torch.Tensor:
        return hf[self.hf].chunk(tp, dim=self.dim)[rank]

    def gather(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.hf: torch.cat(shards, dim=self.dim)}


@dataclass(frozen=True)
class VocabRows:
    """Embedding / output rows [vocab, h], zero-padded to `padded` rows, split by rows."""

    hf: str
    vocab: int
    padded: int
    partition_dim = 0

    def shard(self, hf: Tensors, rank: int, tp: int) -> torch.Tensor:
        full = hf[self.hf]
        if self.padded > self.vocab:
            full = torch.cat([full, full.new_zeros(self.padded - self.vocab, *full.shape[1:])])
        return full.chunk(tp, dim=0)[rank]

    def gather(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.hf: torch.cat(shards, dim=0)[: self.vocab]}


@dataclass(frozen=True)
class FusedQKV:
    """q [heads*d, ...], k/v [groups*d, ...] <-> Megatron's per-group interleaved rows."""

    q: str
    k: str
    v: str
    heads: int
    groups: int
    head_dim: int
    partition_dim = 0

    def _interleave(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rest = q.shape[1:]
        per_group = self.heads // self.groups * self.head_dim
        q = q.reshape(self.groups, per_group, *rest)
        k = k.reshape(self.groups, self.head_dim, *rest)
        v = v.reshape(self.groups, self.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def shard(self, hf: Tensors, rank: int, tp: int) -> torch.Tensor:
        return self._interleave(hf[self.q], hf[self.k], hf[self.v]).chunk(tp, dim=0)[rank]

    def gather(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        per_group = self.heads // self.groups * self.head_dim
        grouped = full.reshape(self.groups, per_group + 2 * self.head_dim, *rest)
        q, k, v = grouped.split([per_group, self.head_dim, self.head_dim], dim=1)
        return {
            self.q: q.reshape(-1, *rest),
            self.k: k.reshape(-1, *rest),
            self.v: v.reshape(-1, *rest),
        }


@dataclass(frozen=True)
class FusedGateUp:
    """gate / up [ffn, h] <-> Megatron's fc1 where rank r holds [gate_r; up_r]."""

    gate: str
    up: str
    partition_dim = 0

    def shard(self, hf: Tensors, rank: int, tp: int) -> torch.Tensor:
        return torch.cat([hf[self.gate].chunk(tp)[rank], hf[self.up].chunk(tp)[rank]])

    def gather(self, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        halves = [shard.chunk(2) for shard in shards]
        return {
            self.gate: torch.cat([gate for gate, _ in halves]),
            self.up: torch.cat([up for _, up in halves]),
        }


Rule = Replicated | Split | VocabRows | FusedQKV | FusedGateUp


def parameter_rules(shape: ModelShape, tp: int) -> dict[str, Rule]:
    """Every Megatron parameter name of the model -> how it is built from HF tensors."""
    padded = shape.padded_vocab(tp)
    rules: dict[str, Rule] = {
        "embedding.word_embeddings.weight": VocabRows(
            "model.embed_tokens.weight", shape.vocab_size, padded
        ),
        "decoder.final_layernorm.weight": Replicated("model.norm.weight"),
    }
    if not shape.tied_embeddings:
        rules["output_layer.weight"] = VocabRows("lm_head.weight", shape.vocab_size, padded)
    for i in range(shape.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        qkv = {
            "heads": shape.num_heads,
            "groups": shape.num_kv_heads,
            "head_dim": shape.head_dim,
        }
        rules[mg + "input_layernorm.weight"] = Replicated(hf + "input_layernorm.weight")
        rules[mg + "self_attention.linear_qkv.weight"] = FusedQKV(
            attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight", **qkv
        )
        if shape.qkv_bias:
            rules[mg + "self_attention.linear_qkv.bias"] = FusedQKV(
                attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias", **qkv
            )
        if shape.qk_norm:
            rules[mg + "self_attention.q_layernorm.weight"] = Replicated(attn + "q_norm.weight")
            rules[mg + "self_attention.k_layernorm.weight"] = Replicated(attn + "k_norm.weight")
        rules[mg + "self_attention.linear_proj.weight"] = Split(attn + "o_proj.weight", dim=1)
        rules[mg + "pre_mlp_layernorm.weight"] = Replicated(hf + "post_attention_layernorm.weight")
        rules[mg + "mlp.linear_fc1.weight"] = FusedGateUp(
            hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"
        )
        rules[mg + "mlp.linear_fc2.weight"] = Split(hf + "mlp.down_proj.weight", dim=1)
    return rules


def hf_to_megatron(hf: Tensors, shape: ModelShape, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The Megatron parameters of TP rank `rank` from a full HF state dict."""
    return {
        name: rule.shard(hf, rank, tp).contiguous()
        for name, rule in parameter_rules(shape, tp).items()
    }


def megatron_to_hf(shards: list[Tensors], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The full HF state dict from every TP rank's Megatron parameters (rank order)."""
    tp = len(shards)
    hf: dict[str, torch.Tensor] = {}
    for name, rule in parameter_rules(shape, tp).items():
        hf.update(rule.gather([shard[name] for shard in shards]))
    return hf
