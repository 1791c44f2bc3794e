"""The step_wise advantage estimator (OpenClaw-RL's, for episodes) against values worked out by
hand: buckets of (task, turn index), population-std normalisation, a bucket of one kept raw,
constant buckets dropped (and taken out of the loss mask), the first kept when all are."""

import math

import pytest
import torch

from clawrl.common.proto.records_pb2 import SampleMode
from clawrl.common.records import Sample
from clawrl.trainer.losses import (
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    step_normalized,
)
from clawrl.trainer.samples import check_mode, collate
from clawrl.trainer.training import without_constant_steps

T = torch.tensor


def test_buckets_are_normalised_with_the_population_std() -> None:
    # Bucket 0 (task A, turn 0): scores 2, -2, 0 -> mean 0, population variance 8/3.
    # Bucket 1 (task A, turn 1): 1, 1 -> constant: dropped. Bucket 2 (task B, turn 0) alone: raw.
    value, kept = step_normalized(T([2.0, -2.0, 0.0, 1.0, 1.0, 0.5]), T([0, 0, 0, 1, 1, 2]))
    unit = 2.0 / (math.sqrt(8.0 / 3.0) + 1e-6)  # 1.2247...
    assert value.tolist() == pytest.approx([unit, -unit, 0.0, 0.0, 0.0, 0.5], abs=1e-6)
    assert kept.tolist() == [True, True, True, False, False, True]


def test_a_two_turn_bucket_is_plus_minus_one() -> None:
    # 3 and -1: mean 1, population std 2 -> (3 - 1) / (2 + 1e-6) and its negative.
    value, kept = step_normalized(T([3.0, -1.0]), T([5, 5]))
    assert value.tolist() == pytest.approx([2 / (2 + 1e-6), -2 / (2 + 1e-6)], abs=1e-7)
    assert kept.all()


def test_when_every_bucket_is_constant_the_first_one_met_is_kept() -> None:
    value, kept = step_normalized(T([-1.0, 1.0, -1.0, 1.0]), T([4, 9, 4, 9]))
    assert kept.tolist() == [True, False, True, False]  # bucket 4 is met first
    assert value.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_the_estimator_puts_each_turns_value_on_its_trained_tokens() -> None:
    inputs = AdvantageInputs(
        reward=T([2.0, -2.0, 0.5]),
        old_logp=torch.zeros(3, 3),
        teacher_logp=torch.zeros(3, 3),
        has_teacher=T([False, False, False]),
        mask=T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]),
        step_group=T([0, 0, 1]),
    )
    adv = compute_advantages(inputs, AdvantageConfig(estimator="step_wise"))
    one = 2.0 / (2.0 + 1e-6)
    expected = [[one, one, 0.0], [-one, 0.0, 0.0], [0.5, 0.5, 0.5]]
    assert adv.flatten().tolist() == pytest.approx(T(expected).flatten().tolist(), abs=1e-6)
    raw = compute_advantages(inputs, AdvantageConfig(estimator="step_wise", step_normalize=False))
    assert raw.tolist() == [[2.0, 2.0, 0.0], [-2.0, 0.0, 0.0], [0.5, 0.5, 0.5]]
    with pytest.raises(ValueError, match="needs a step_group"):
        compute_advantages(
            AdvantageInputs(**{**inputs.__dict__, "step_group": None}),
            AdvantageConfig(estimator="step_wise"),
        )


def sample(sample_id: str, turn_index: int, reward: float, task_id: str = "") -> Sample:
    return Sample(
        sample_id=sample_id, session_id=sample_id.split(":")[0], turn_index=turn_index,
        prompt_ids=[1, 2], response_ids=[3, 4], old_logprobs=[-0.5, -0.5], loss_mask=[1.0, 1.0],
        reward=reward, task_id=task_id, mode=SampleMode.SAMPLE_MODE_BINARY_RL,
    )  # fmt: skip


def test_a_bucket_is_the_task_and_turn_index_else_the_session_state() -> None:
    batch = collate([
        sample("a:e1:0", 0, 2.0, "sort-numbers"),
        sample("b:e2:0", 0, -2.0, "sort-numbers"),  # another episode of the same task
        sample("a:e1:1", 1, 1.0, "sort-numbers"),
        sample("c:e3:0", 0, 1.0),  # no task named: its own session state is its group
        sample("c:e3:1", 1, 1.0),
        sample("d:e4:0", 0, 1.0),
    ])  # fmt: skip
    assert batch.step_group.tolist() == [0, 0, 1, 2, 3, 4]


def test_constant_buckets_leave_the_loss_mask() -> None:
    batch = collate([
        sample("a:e1:0", 0, 1.0, "t"),
        sample("b:e2:0", 0, 1.0, "t"),  # bucket (t, 0) is constant: dropped
        sample("a:e1:1", 1, 2.0, "t"),
        sample("b:e2:1", 1, 0.0, "t"),
    ])  # fmt: skip
    cfg = AdvantageConfig(estimator="step_wise")
    kept, dropped = without_constant_steps(batch, cfg)
    assert dropped == 2
    assert kept.loss_mask.tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert without_constant_steps(batch, AdvantageConfig(estimator="grpo")) == (batch, 0)
    off = AdvantageConfig(estimator="step_wise", step_normalize=False)
    assert without_constant_steps(batch, off) == (batch, 0)


def test_step_wise_trains_rl_samples() -> None:
    check_mode(sample("a:e1:0", 0, 1.0), "step_wise")
