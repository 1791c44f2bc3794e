"""Wire `Sample` records -> checked training samples -> the tensor `TrainBatch`.

Pure functions: what cannot be trained is named here (a reason string for the dead-letter
stream), never guessed at later.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from clawrl.common.proto.records_pb2 import SampleMode
from clawrl.common.records import Sample, session_state_of
from clawrl.trainer.backend import TrainBatch


class BadSample(ValueError):
    """A sample that can never be trained; the message is the dead-letter reason."""


class ModeMismatch(BadSample):
    """A sample whose judging mode cannot feed the trainer's advantage estimator."""


# The judge's mode and the trainer's estimator are one choice made in two deployments (OpenClaw-RL
# has one knob for both): grpo reads only the reward, which an opd sample does not carry (always
# 0); on_policy_distillation reads only teacher log-probs, which an rl sample lacks; combine
# trains what a combine judge makes. Any other pairing trains all-zero or half-meaningful
# advantages without a word, so each estimator takes exactly its own mode.
ESTIMATOR_MODES = {
    "grpo": SampleMode.SAMPLE_MODE_BINARY_RL,
    "on_policy_distillation": SampleMode.SAMPLE_MODE_OPD,
    "combine": SampleMode.SAMPLE_MODE_COMBINED,
    "step_wise": SampleMode.SAMPLE_MODE_BINARY_RL,  # the reward is each turn's step score
}
JUDGING_MODES = {
    SampleMode.SAMPLE_MODE_BINARY_RL: "rl",
    SampleMode.SAMPLE_MODE_OPD: "opd",
    SampleMode.SAMPLE_MODE_COMBINED: "combine",
}


def check_mode(sample: Sample, estimator: str) -> None:
    """Raise ModeMismatch with the reason unless `sample` was judged in the mode `estimator`
    trains (see ESTIMATOR_MODES)."""
    wanted = ESTIMATOR_MODES[estimator]
    if sample.mode == wanted:
        return
    made = JUDGING_MODES.get(sample.mode, f"unspecified ({SampleMode.Name(sample.mode)})")
    raise ModeMismatch(
        f"sample judged in mode {made!r} cannot feed the trainer's estimator {estimator!r}, "
        f"which trains samples of judging.mode = {JUDGING_MODES[wanted]!r}: the judge and the "
        "trainer are configured for different modes"
    )


def is_trainable(sample: Sample) -> bool:
    """Masked samples (a mask reason, or no token with loss weight) never fill a batch."""
    return sample.mask_reason == 0 and any(w > 0 for w in sample.loss_mask)


def check_sample(sample: Sample, vocab_size: int, max_length: int) -> None:
    """Raise BadSample with the reason when the sample's fields do not fit together."""
    n = len(sample.response_ids)
    if not sample.sample_id:
        raise BadSample("sample has no sample_id")
    if n == 0:
        raise BadSample("no response ids")
    if not sample.prompt_ids:
        raise BadSample("no prompt ids (the first response token has nothing to follow)")
    if len(sample.old_logprobs) != n:
        raise BadSample(f"old_logprobs has {len(sample.old_logprobs)} entries for {n} response ids")
    if len(sample.loss_mask) != n:
        raise BadSample(f"loss_mask has {len(sample.loss_mask)} entries for {n} response ids")
    if any(not (w == 0.0 or w == 1.0) for w in sample.loss_mask):
        raise BadSample("loss_mask holds values other than 0 and 1")
    if any(not math.isfinite(lp) or lp > 1e-4 for lp in sample.old_logprobs):
        raise BadSample("old_logprobs holds a value that is not a finite log-probability")
    if sample.has_teacher:
        if len(sample.teacher_logprobs) != n:
            raise BadSample(
                f"teacher_logprobs has {len(sample.teacher_logprobs)} entries for {n} response ids"
            )
        if any(not math.isfinite(lp) for lp in sample.teacher_logprobs):
            raise BadSample("teacher_logprobs holds a value that is not finite")
    k = sample.teacher_top_k
    if k:
        if len(sample.teacher_topk_ids) != n * k or len(sample.teacher_topk_logprobs) != n * k:
            held = (len(sample.teacher_topk_ids), len(sample.teacher_topk_logprobs))
            raise BadSample(
                f"teacher top-K holds {held[0]} ids and {held[1]} log-probs for {n} x {k}"
            )
        if any(not 0 <= t < vocab_size for t in sample.teacher_topk_ids):
            raise BadSample(f"a teacher top-K id is outside the vocabulary (size {vocab_size})")
    for name, ids in (("prompt", sample.prompt_ids), ("response", sample.response_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadSample(f"{name} id {bad} is outside the vocabulary (size {vocab_size})")
    if len(sample.prompt_ids) + n > max_length:
        raise BadSample(
            f"prompt + response is {len(sample.prompt_ids) + n} tokens, over the trainer's "
            f"limit of {max_length}"
        )


def collate(samples: Sequence[Sample]) -> TrainBatch:
    """Checked samples -> TrainBatch (right-padded, see backend.TrainBatch)."""
    batch_size = len(samples)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(len(s.response_ids) for s in samples)
    top_k = max(s.teacher_top_k for s in samples)
    input_ids = torch.zeros(batch_size, max(lengths), dtype=torch.long)
    per_token = {
        name: torch.zeros(batch_size, width)
        for name in ("loss_mask", "rollout_logp", "teacher_logp")
    }
    topk_ids = torch.zeros(batch_size, width, top_k, dtype=torch.long) if top_k else None
    topk_logp = torch.zeros(batch_size, width, top_k) if top_k else None
    has_topk = torch.zeros(batch_size, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        input_ids[i, : lengths[i]] = torch.tensor([*s.prompt_ids, *s.response_ids])
        per_token["loss_mask"][i, :n] = torch.tensor(list(s.loss_mask))
        per_token["rollout_logp"][i, :n] = torch.tensor(list(s.old_logprobs))
        if s.has_teacher:
            per_token["teacher_logp"][i, :n] = torch.tensor(list(s.teacher_logprobs))
        # A sample whose K differs from the batch's takes no part in top-K distillation.
        if top_k and s.teacher_top_k == top_k and s.has_teacher:
            topk_ids[i, :n] = torch.tensor(list(s.teacher_topk_ids)).view(n, top_k)
            topk_logp[i, :n] = torch.tensor(list(s.teacher_topk_logprobs)).view(n, top_k)
            has_topk[i] = True
    return TrainBatch(
        sample_ids=tuple(s.sample_id for s in samples),
        input_ids=input_ids,
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples]),
        response_lengths=torch.tensor([len(s.response_ids) for s in samples]),
        reward=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        has_teacher=torch.tensor([s.has_teacher for s in samples]),
        policy_versions=torch.tensor([s.policy_version for s in samples]),
        teacher_topk_ids=topk_ids,
        teacher_topk_logp=topk_logp,
        has_topk=has_topk,
        group_index=torch.tensor(_group_index([session_state_of(s.sample_id) for s in samples])),
        step_group=torch.tensor(_group_index([step_bucket(s) for s in samples])),
        **per_token,
    )


def step_bucket(sample: Sample) -> str:
    """The step_wise bucket of a sample: its task (the episode's task_id, else its own session
    state: an episode with no task named is its own group) and its turn index, as OpenClaw-RL
    buckets by (task group, step index)."""
    if sample.task_id:
        return f"task:{sample.task_id}\n{sample.turn_index}"
    return f"session:{session_state_of(sample.sample_id)}\n{sample.turn_index}"


def _group_index(keys: Sequence[str]) -> list[int]:
    """One integer per distinct key, in order of first appearance."""
    index: dict[str, int] = {}
    return [index.setdefault(key, len(index)) for key in keys]
