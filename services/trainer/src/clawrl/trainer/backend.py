"""The training-backend interface and the tensor batch it consumes.

A backend owns a model and its optimizer on some devices (the PyTorch backend: one process, CPU or
one GPU; the Megatron backend: a tensor/pipeline-parallel group). The driver hands it a
`TrainBatch` and calls, once per step:

    old_logp = backend.compute_logprobs(batch)                  # on the current weights, no grad
    ref_logp = backend.compute_logprobs(batch, "reference")     # only when kl_coef > 0
    advantages = losses.compute_advantages(...)                 # pure, on the driver
    metrics = backend.train_step(batch.with_targets(old_logp, advantages, ref_logp), loss_cfg)

and, between steps, `export_hf` (safetensors the engines load) and `save_state`/`load_state`
(everything needed to resume the optimizer exactly). The loss itself is `losses.policy_objective`,
shared by every backend; a backend only turns its model's logits into `losses.TokenTerms`.

Batch layout: `input_ids` [B, L] is each sample's prompt followed by its response, right-padded
with 0; sample i's response occupies positions prompt_lengths[i] .. + response_lengths[i], and
every per-token field is [B, R] aligned with the response (R = the longest response), padded
with 0 and masked by `loss_mask`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from clawrl.trainer.losses import LossConfig, TokenTerms, micro_batch_weight, policy_objective

Which = Literal["policy", "reference"]


@dataclass(frozen=True)
class TrainBatch:
    """One step's samples as tensors (see the module docstring for the layout).

    input_ids: [B, L] int64; prompt_lengths, response_lengths: [B] int64; loss_mask,
    rollout_logp, teacher_logp: [B, R] float32; reward: [B] float32; has_teacher: [B] bool;
    teacher_topk_ids / teacher_topk_logp: [B, R, K] or None when no sample carries a top-K,
    has_topk: [B] bool (the sample's top-K is valid); group_index: [B] int64 (samples of one
    session share it: GRPO groups); step_group: [B] int64 (samples of one task and turn index
    share it: step_wise buckets);
    old_logp, ref_logp, advantages: [B, R], filled in by the driver before `train_step`."""

    sample_ids: tuple[str, ...]
    input_ids: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor
    loss_mask: Tensor
    rollout_logp: Tensor
    teacher_logp: Tensor
    reward: Tensor
    has_teacher: Tensor
    policy_versions: Tensor
    teacher_topk_ids: Tensor | None = None
    teacher_topk_logp: Tensor | None = None
    has_topk: Tensor | None = None
    group_index: Tensor | None = None
    step_group: Tensor | None = None
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    advantages: Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.sample_ids)

    @property
    def lengths(self) -> Tensor:
        """[B]: prompt + response tokens of each sample."""
        return self.prompt_lengths + self.response_lengths

    @property
    def response_width(self) -> int:
        return int(self.loss_mask.shape[1])

    def with_targets(
        self, old_logp: Tensor, advantages: Tensor, ref_logp: Tensor | None = None
    ) -> TrainBatch:
        """The batch with what `train_step` needs besides the samples."""
        return dataclasses.replace(
            self, old_logp=old_logp, advantages=advantages, ref_logp=ref_logp
        )

    def select(self, indices: list[int]) -> TrainBatch:
        """The sub-batch of `indices`, trimmed to its own longest sequence and response."""
        index = torch.tensor(indices, dtype=torch.long)
        width = int(self.lengths[index].max())
        resp = int(self.response_lengths[index].max())

        def pick(value):
            if not isinstance(value, Tensor):
                return value
            value = value.index_select(0, index)
            return value if value.dim() == 1 else value[:, :resp]

        picked = {f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)}
        picked["input_ids"] = self.input_ids.index_select(0, index)[:, :width]
        picked["sample_ids"] = tuple(self.sample_ids[i] for i in indices)
        return TrainBatch(**picked)


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of samples grouped, in order, so that each group's padded size (count x longest)
    stays within `max_tokens`; a sample longer than the budget forms a group of its own."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def accumulate_gradients(
    batch: TrainBatch,
    loss_cfg: LossConfig,
    max_tokens: int,
    terms_of: Callable[[TrainBatch], TokenTerms],
) -> dict[str, float]:
    """Forward and backward over the micro-batches of `batch` (`terms_of` runs the model on one);
    each micro-batch's loss is weighted so the accumulated gradients equal one pass over the
    whole batch. -> the step's metrics, weighted the same way. The caller zeroes gradients
    before and steps the optimizer after."""
    totals: dict[str, float] = {}
    for group in micro_batches(batch.lengths.tolist(), max_tokens):
        micro = batch.select(group)
        weight = micro_batch_weight(micro.loss_mask, batch.loss_mask, loss_cfg.aggregation)
        loss, metrics = policy_objective(terms_of(micro), loss_cfg)
        (loss * weight).backward()
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + weight * float(value)
    return totals


def response_rows(hidden: Tensor, prompt_lengths: Tensor, width: int) -> Tensor:
    """hidden: [B, L, ...] per-position model outputs (logits) -> [B, width, ...]: the rows that
    predict each response token (position p + j - 1 predicts token p + j); rows past a sample's
    end repeat its last valid row and must be masked."""
    steps = torch.arange(width, device=hidden.device)
    rows = (prompt_lengths.to(hidden.device)[:, None] - 1 + steps[None, :]).clamp(
        max=hidden.shape[1] - 1
    )
    index = rows.view(*rows.shape, *([1] * (hidden.dim() - 2)))
    return hidden.gather(1, index.expand(-1, -1, *hidden.shape[2:]))


def response_targets(batch: TrainBatch) -> Tensor:
    """-> [B, R]: the response ids aligned with the per-token fields (0 past each end)."""
    rows = response_rows(batch.input_ids[..., None], batch.prompt_lengths + 1, batch.response_width)
    valid = torch.arange(batch.response_width)[None, :] < batch.response_lengths[:, None]
    return torch.where(valid, rows[..., 0], 0)


@runtime_checkable
class TrainerBackend(Protocol):
    """What the driver needs from a training backend. Implementations: torch_backend
    (HF transformers, one process), megatron (Megatron-core, model parallel)."""

    def load(self, model_dir: Path, *, load_reference: bool) -> None:
        """Load the policy (and the frozen reference model when `load_reference`) from an HF
        directory, and create the optimizer."""
        ...

    def vocab_size(self) -> int:
        """Rows of the output embedding: token ids must be below it (a method, not a property,
        so it can be called on a Ray actor)."""
        ...

    def compute_logprobs(self, batch: TrainBatch, which: Which = "policy") -> Tensor:
        """[B, R] float32 log-probs (raw distribution) of each response token under the current
        policy weights or the reference model, without gradients; 0 past each response."""
        ...

    def train_step(self, batch: TrainBatch, loss_cfg: LossConfig) -> dict[str, float]:
        """One optimizer step on the whole batch (micro-batches with gradient accumulation,
        gradient clipping); returns the step's metrics (loss, pg_loss, clip_frac, entropy,
        grad_norm, ... as `losses.policy_objective` and the backend name them)."""
        ...

    def export_hf(self, path: Path) -> None:
        """Write the policy as an HF directory (config, safetensors, tokenizer) into `path`,
        which the caller creates and later renames into place."""
        ...

    def save_state(self, path: Path) -> None:
        """Write weights and optimizer state into the directory `path` (created by the caller)."""
        ...

    def load_state(self, path: Path) -> None:
        """Restore what `save_state` wrote, after `load`."""
        ...
