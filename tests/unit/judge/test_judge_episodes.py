"""An episode's turn at the judge: OpenClaw-RL's formula (2 * outcome - 1) + prm_step_coef * step
score on exact values, the turn trained whatever its score (a 0 step score is no neutral mask),
the step score not asked with the coefficient 0, a missing outcome masked and counted, and a
chat turn judged as before."""

from __future__ import annotations

import json

import pytest

from clawrl.common.episodes import Outcome
from clawrl.common.proto.records_pb2 import MaskReason, Turn
from clawrl.judge.core import Judge
from clawrl.judge.episodes import EpisodeWait, episode_score
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.rewards import load_reward_fn
from clawrl.judge.turns import TurnView

BY_RESPONSE = "tests.integration.judge.plugins:by_response"  # "+1" -> 1, "-1" -> -1, "0" -> 0


@pytest.mark.parametrize(
    ("outcome", "step", "coef", "expected"),
    [
        (1.0, 1.0, 1.0, 2.0),  # success, a good step
        (1.0, -1.0, 1.0, 0.0),  # success, a bad step
        (0.0, -1.0, 1.0, -2.0),  # failure, a bad step
        (0.0, 1.0, 0.5, -0.5),  # failure, a good step, coefficient 0.5
        (0.25, 1.0, 2.0, 1.5),  # a checker's score: -0.5 + 2
        (1.0, None, 1.0, 1.0),  # no step score (no next state, or not asked): counts 0
        (0.5, 0.0, 1.0, 0.0),
    ],
)
def test_openclaw_rls_formula(outcome: float, step: float | None, coef: float, expected) -> None:
    assert episode_score(outcome, step, coef) == expected


def turn(reply: str, episode: bool = True) -> Turn:
    t = Turn(turn_id="s:e:1", session_id="s", turn_index=1, episode=episode,
             messages_json='[{"role":"user","content":"List the files"}]',
             response_ids=[5, 6], response_logprobs=[-0.1, -0.2], response_text=reply)  # fmt: skip
    t.next_state_messages_json.append(json.dumps({"role": "tool", "content": "a.txt b.txt"}))
    return t


def found(outcome: float, task_id: str = "list-files") -> EpisodeWait:
    return EpisodeWait(Outcome(outcome, task_id, "checker: ok"), waited_s=1.25)


def judge(metrics: JudgeMetrics, reward_fn: str = BY_RESPONSE, coef: float = 1.0) -> Judge:
    return Judge(mode="rl", metrics=metrics, reward_fn=load_reward_fn(reward_fn),
                 prm_step_coef=coef)  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "outcome", "coef", "reward"),
    [("+1", 1.0, 1.0, 2.0), ("-1", 0.0, 1.0, -2.0), ("+1", 0.0, 0.5, -0.5), ("0", 0.5, 1.0, 0.0)],
)
async def test_an_episodes_turn_is_trained_with_the_merged_score(
    reply: str, outcome: float, coef: float, reward: float
) -> None:
    metrics = JudgeMetrics()
    made = await judge(metrics, coef=coef).judge(TurnView(turn(reply)), episode=found(outcome))
    sample = made.sample
    assert made.effective and set(sample.loss_mask) == {1.0}  # a 0 reward is trained too
    assert sample.reward == reward
    assert sample.outcome == outcome and sample.task_id == "list-files"
    assert sample.step_score == {"+1": 1.0, "-1": -1.0, "0": 0.0}[reply]
    assert sample.reward_source == f"outcome+reward_fn:{BY_RESPONSE}"
    assert made.audit["episode"] == {
        "outcome": outcome, "task_id": "list-files", "detail": "checker: ok", "waited_s": 1.25,
        "step_score": sample.step_score, "prm_step_coef": coef,
    }  # fmt: skip
    assert made.audit["score"] == reward
    assert metrics.episode_turns.labels("merged")._value.get() == 1


async def test_the_step_score_is_not_asked_with_a_zero_coefficient() -> None:
    metrics = JudgeMetrics()
    failing = "tests.integration.judge.plugins:fails"  # raises if it is called
    made = await judge(metrics, failing, coef=0.0).judge(TurnView(turn("+1")), episode=found(0.0))
    assert made.effective and made.sample.reward == -1.0
    assert made.sample.reward_source == "outcome" and made.sample.step_score == 0.0


async def test_a_missing_outcome_masks_the_turn() -> None:
    metrics = JudgeMetrics()
    made = await judge(metrics).judge(TurnView(turn("+1")), episode=EpisodeWait(None, 600.0))
    assert made.sample.mask_reason == MaskReason.MASK_REASON_NO_OUTCOME
    assert set(made.sample.loss_mask) == {0.0} and made.sample.reward == 0.0
    assert not made.sample.HasField("outcome")
    assert made.audit["episode"] == {"outcome": None, "expired": True, "waited_s": 600.0}
    assert metrics.episode_turns.labels("no_outcome")._value.get() == 1
    assert metrics.masked.labels("MASK_REASON_NO_OUTCOME")._value.get() == 1


async def test_a_chat_turn_is_judged_as_before() -> None:
    """No episode: a 0 score is still the neutral mask, and nothing of an episode is set."""
    metrics = JudgeMetrics()
    chat = await judge(metrics).judge(TurnView(turn("0", episode=False)))
    assert chat.sample.mask_reason == MaskReason.MASK_REASON_NEUTRAL_SCORE
    trained = await judge(metrics).judge(TurnView(turn("+1", episode=False)))
    assert trained.sample.reward == 1.0 and trained.sample.reward_source.startswith("reward_fn")
    assert not trained.sample.HasField("outcome") and not trained.sample.HasField("step_score")
    assert "episode" not in trained.audit
    assert metrics.episode_turns.labels("merged")._value.get() == 0
