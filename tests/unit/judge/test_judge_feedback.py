"""How explicit feedback meets the judge's score (pure): override, the weighted sum by hand,
and which of several feedbacks counts."""

from __future__ import annotations

import pytest

from clawrl.common.feedback import Feedback
from clawrl.judge.feedback import TurnFeedback, merged_reward, ordered


def test_override_is_the_explicit_reward() -> None:
    assert merged_reward(-0.5, 1.0, "override", 0.9) == -0.5


@pytest.mark.parametrize(
    ("explicit", "judged", "weight", "expected"),
    [(-1.0, 1.0, 0.25, 0.5), (1.0, -1.0, 0.5, 0.0), (0.5, 0.0, 1.0, 0.5), (1.0, -1.0, 0.0, -1.0)],
)
def test_weighted_sum(explicit, judged, weight, expected) -> None:
    assert merged_reward(explicit, judged, "weighted", weight) == pytest.approx(expected)


def test_weighted_without_a_judge_score_is_the_explicit_reward() -> None:
    assert merged_reward(0.5, None, "weighted", 0.25) == 0.5


def test_the_latest_reward_and_the_latest_comment_count() -> None:
    entries = ordered([
        Feedback("c", reward=-1.0, at=3.0),
        Feedback("a", thumbs="up", comment="first", at=1.0),
        Feedback("b", comment="second", at=2.0),
    ])  # fmt: skip
    feedback = TurnFeedback(entries)
    assert feedback.ids == ["a", "b", "c"]
    assert feedback.reward == -1.0 and feedback.comment == "second"
    assert TurnFeedback((Feedback("a", comment="only"),)).reward is None
    assert TurnFeedback().comment == "" and TurnFeedback().reward is None
