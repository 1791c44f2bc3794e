"""The fault-injection run's verdict (tests/integration/chaos/harness.py `problems`): a sound
run's tallies pass, and each way of losing, duplicating or stalling is named."""

from __future__ import annotations

import pytest

from tests.integration.chaos.harness import Plan, problems

PLAN = Plan(batch_size=4, judge_kills=1, trainer_kills=1, launcher_kills=1)


def sound() -> dict:
    return {
        "served": 12, "recorded": 12, "not_recorded": [], "turns_without_sample": [],
        "samples_without_turn": [], "trained_not_trainable": [], "waiting_not_pending": [],
        "dead_letters": [], "duplicate_samples": 0, "trained_twice": 0, "trainable": 11,
        "masked": {"MASK_REASON_MIXED_POLICY": 1}, "retracted": 1, "trained_distinct": 8,
        "dropped": {}, "waiting": 3, "trainer_processes_left": 0,
        "versions": {"announced": 2, "trainer": 2, "engine": "2", "gateway-0": 2},
        "kills": {"judge": 1, "trainer": 1, "launcher": 1},
        "kills_mid_work": {"judge": 1, "trainer": 1, "launcher": 1},
    }  # fmt: skip


def test_a_sound_run_has_no_problem():
    assert problems(sound(), PLAN) == []


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"recorded": 11, "not_recorded": [("s", 3)]}, "1 served turns not recorded"),
        ({"turns_without_sample": ["s:e:3"]}, "turns_without_sample"),
        ({"dead_letters": [{"reason": "x"}]}, "dead_letters"),
        ({"duplicate_samples": 1}, "duplicate_samples: 1"),
        ({"trained_twice": 2}, "trained_twice: 2"),
        ({"waiting": 2}, "trainable 11 != trained 8 + dropped 0 + waiting 2"),
        ({"waiting": 4, "trained_distinct": 7}, "4 trainable samples stranded"),
        ({"dropped": {"stale": 1}, "trained_distinct": 7}, None),
        ({"dropped": {"invalid": 1}, "trained_distinct": 7}, "dropped for other reasons"),
        ({"retracted": 0}, "1 turns masked as mixed-policy or unknown-version, 0 generations"),
        (
            {"versions": {"announced": 3, "trainer": 3, "engine": "3", "gateway-0": 2}},
            "versions not converged",
        ),
        ({"kills_mid_work": {"judge": 1, "trainer": 0, "launcher": 1}}, "never killed mid-work"),
        ({"trainer_processes_left": 3}, "3 trainer (Ray) processes left"),
    ],
)
def test_each_defect_is_named(change, named):
    found = problems(sound() | change, PLAN)
    if named is None:  # staleness is a reason the trainer gives, counted: not a defect
        assert found == []
    else:
        assert len(found) == 1 and named in found[0], found
