"""Sample checks (every dead-letter reason) and collation into the tensor batch."""

import math

import pytest

from clawrl.common.proto.records_pb2 import SampleMode
from clawrl.common.records import Sample
from clawrl.trainer.samples import (
    BadSample,
    ModeMismatch,
    check_mode,
    check_sample,
    collate,
    is_trainable,
)

VOCAB = 100


def sample(**overrides) -> Sample:
    fields = dict(
        sample_id="sess:0", session_id="sess", prompt_ids=[1, 2, 3], response_ids=[4, 5],
        old_logprobs=[-0.5, -1.5], loss_mask=[1.0, 1.0], reward=1.0, policy_version=3,
    )  # fmt: skip
    fields.update(overrides)
    return Sample(**fields)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"sample_id": ""}, "no sample_id"),
        ({"response_ids": [], "old_logprobs": [], "loss_mask": []}, "no response ids"),
        ({"prompt_ids": []}, "no prompt ids"),
        ({"old_logprobs": [-0.5]}, "old_logprobs has 1 entries for 2 response ids"),
        ({"loss_mask": [1.0]}, "loss_mask has 1 entries for 2 response ids"),
        ({"loss_mask": [1.0, 0.5]}, "other than 0 and 1"),
        ({"old_logprobs": [-0.5, math.nan]}, "not a finite log-probability"),
        ({"old_logprobs": [-0.5, 0.7]}, "not a finite log-probability"),
        ({"has_teacher": True, "teacher_logprobs": [-1.0]}, "teacher_logprobs has 1 entries"),
        ({"response_ids": [4, 100]}, "response id 100 is outside the vocabulary (size 100)"),
        ({"prompt_ids": [-1, 2]}, "prompt id -1 is outside the vocabulary"),
        (
            {
                "teacher_top_k": 2,
                "teacher_topk_ids": [1, 2, 3],
                "teacher_topk_logprobs": [-1.0] * 4,
            },
            "teacher top-K holds 3 ids",
        ),
        ({"prompt_ids": list(range(9))}, "over the trainer's limit of 10"),
    ],
)
def test_bad_samples_are_named(overrides, reason) -> None:
    with pytest.raises(BadSample, match=reason.replace("(", r"\(").replace(")", r"\)")):
        check_sample(sample(**overrides), VOCAB, max_length=10)


def test_a_good_sample_passes() -> None:
    check_sample(sample(), VOCAB, max_length=10)


def test_masked_samples_are_not_trainable() -> None:
    assert is_trainable(sample())
    assert not is_trainable(sample(mask_reason=2))
    assert not is_trainable(sample(loss_mask=[0.0, 0.0]))


def test_collate_pads_and_aligns() -> None:
    a = sample()
    b = sample(sample_id="other:0", session_id="other", prompt_ids=[7], response_ids=[8, 9, 10],
               old_logprobs=[-1.0, -2.0, -3.0], loss_mask=[1.0, 0.0, 1.0], reward=-1.0,
               has_teacher=True, teacher_logprobs=[-0.1, -0.2, -0.3], teacher_top_k=1,
               teacher_topk_ids=[8, 9, 10], teacher_topk_logprobs=[-0.1, -0.2, -0.3])  # fmt: skip
    batch = collate([a, b])
    assert batch.sample_ids == ("sess:0", "other:0")
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 10, 0]]
    assert batch.prompt_lengths.tolist() == [3, 1]
    assert batch.response_lengths.tolist() == [2, 3]
    assert batch.loss_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    assert batch.rollout_logp.tolist() == [[-0.5, -1.5, 0.0], [-1.0, -2.0, -3.0]]
    assert batch.teacher_logp[1].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.teacher_logp[0].tolist() == [0.0, 0.0, 0.0]
    assert batch.has_teacher.tolist() == [False, True]
    assert batch.has_topk.tolist() == [False, True]
    assert batch.teacher_topk_ids[1, :, 0].tolist() == [8, 9, 10]
    assert batch.reward.tolist() == [1.0, -1.0]
    assert batch.policy_versions.tolist() == [3, 3]
    assert batch.group_index.tolist() == [0, 1]
    assert collate([a]).teacher_topk_ids is None


def test_a_group_is_one_session_state_not_a_shared_session_id() -> None:
    """GRPO groups the turns of one session state (`{session_id}:{epoch}` in the turn id):
    two callers that both send `X-Session-Id: main` hold two states and two groups."""
    turns = ["main:e1:0", "main:e1:1", "main:e2:0", "other:e3:0"]
    batch = collate([sample(sample_id=t, session_id=t.split(":")[0]) for t in turns])
    assert batch.group_index.tolist() == [0, 0, 1, 2]


@pytest.mark.parametrize(
    ("estimator", "mode"),
    [
        ("grpo", SampleMode.SAMPLE_MODE_BINARY_RL),
        ("on_policy_distillation", SampleMode.SAMPLE_MODE_OPD),
        ("combine", SampleMode.SAMPLE_MODE_COMBINED),
    ],
)
def test_each_estimator_trains_its_own_mode_only(estimator: str, mode: int) -> None:
    check_mode(sample(mode=mode), estimator)
    for other in SampleMode.values():
        if other != mode:
            with pytest.raises(ModeMismatch, match=f"the trainer's estimator '{estimator}'"):
                check_mode(sample(mode=other), estimator)


def test_a_mode_mismatch_names_both_sides() -> None:
    with pytest.raises(ModeMismatch) as caught:
        check_mode(sample(mode=SampleMode.SAMPLE_MODE_OPD), "grpo")
    assert str(caught.value) == (
        "sample judged in mode 'opd' cannot feed the trainer's estimator 'grpo', which trains "
        "samples of judging.mode = 'rl': the judge and the trainer are configured for different "
        "modes"
    )
