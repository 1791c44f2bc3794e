"""The step_wise estimator in the real trainer (tiny model, real Redis): episodes' turns of one
task normalised per turn index, a constant bucket taken out of the loss (its samples still
consumed with the step), the step's figures and gauge."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from .helpers import counter, make_sample, pending, publish_all, settings_for, start_trainer

pytestmark = pytest.mark.integration


@pytest.fixture
async def redis(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_step_wise_step_normalises_per_task_and_turn(redis, redis_url, tmp_path) -> None:
    settings = settings_for(redis_url, tmp_path, advantage={"estimator": "step_wise"})
    trainer = await start_trainer(settings, redis)
    # Two episodes of task "t": turn 0 scored 2 (won, good step) and 0 (lost, good step) -> +-1
    # after normalisation; turn 1 scored 1 in both -> a constant bucket, not trained.
    await publish_all(redis, settings, [
        make_sample("won:e:0", [10, 11], reward=2.0, turn_index=0, task_id="t"),
        make_sample("lost:e:0", [12, 13], reward=0.0, turn_index=0, task_id="t"),
        make_sample("won:e:1", [14], reward=1.0, turn_index=1, task_id="t"),
        make_sample("lost:e:1", [15], reward=1.0, turn_index=1, task_id="t"),
    ])  # fmt: skip
    collected = await trainer.intake.next_batch(
        0, trainer.trained.__contains__, trainer.uncommitted, asyncio.Event(), block_ms=100
    )
    report = await trainer.step(collected)
    assert report.sample_ids == ("won:e:0", "lost:e:0", "won:e:1", "lost:e:1")
    figures = report.figures
    assert figures["step_wise_dropped"] == 2
    # Trained tokens: 2 at +1/(1+1e-6), 2 at -1/(1+1e-6).
    assert figures["advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    assert figures["advantage_std"] == pytest.approx(1.0, abs=1e-5)
    assert counter(trainer, "clawrl_trainer_step_wise_dropped") == 2
    assert counter(trainer, "clawrl_trainer_samples_consumed_total", kind="trained") == 4
    assert await pending(redis, settings) == 0
