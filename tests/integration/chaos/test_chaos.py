"""A small chaos run in `make test` (the full-size one is tests/bench/bench_chaos.py): the judge
killed mid-turn, the trainer mid-step and the launcher mid-sync, under load; every served turn
recorded, one sample per turn, every trainable sample trained once (none twice, none stranded),
no dead letters, gateways and engine on the newest version."""

from __future__ import annotations

import pytest

from .harness import Plan, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_judge_trainer_and_launcher_killed_under_load(tmp_path):
    # settle_s: the wait for everything to converge ends as soon as it has; a loaded host
    # restarting the trainer's Ray runtime may need minutes.
    plan = Plan(seed=0, sessions=4, turns=3, concurrency=2, think_s=(0.5, 1.5), batch_size=2,
                judge_kills=1, trainer_kills=1, launcher_kills=1, gap_s=(0.5, 1.0),
                settle_s=240)  # fmt: skip
    tallies, problems = run(tmp_path, plan)
    print(tallies)
    assert problems == [], tallies
    assert tallies["served"] >= plan.sessions * plan.turns
