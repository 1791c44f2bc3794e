"""The trainer alone learns (real Redis, tiny model): on a fixed set of samples with positive and
negative rewards, repeated steps raise the log-probs of the positive responses and lower those
of the negative ones."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from redis.asyncio import Redis

from clawrl.trainer.samples import collate

from .helpers import make_sample, publish_all, settings_for, start_trainer

pytestmark = pytest.mark.integration

# Two responses rewarded, two punished, to the same prompt.
RESPONSES = {(100, 101, 102, 103): 1.0, (200, 201, 202): 1.0,
             (300, 301, 302, 303): -1.0, (400, 401): -1.0}  # fmt: skip
ROUNDS = 5


async def test_repeated_steps_follow_the_rewards(redis_url, tmp_path) -> None:
    redis = Redis.from_url(redis_url)
    settings = settings_for(redis_url, tmp_path, ppo={"lr": 1e-4})
    trainer = await start_trainer(settings, redis)
    fixed = [make_sample(f"fixed{i}:0", list(r), reward) for i, (r, reward) in
             enumerate(RESPONSES.items())]  # fmt: skip
    batch = collate(fixed)
    rewards = batch.reward

    async def mean_logp() -> torch.Tensor:
        logp = await trainer.backend.call("compute_logprobs", batch)
        return (logp * batch.loss_mask).sum(dim=1) / batch.loss_mask.sum(dim=1)

    history = [await mean_logp()]
    for round_index in range(ROUNDS):
        # The same samples again each round, as fresh on-policy samples of the current version.
        await publish_all(redis, settings, [
            make_sample(f"r{round_index}-{s.sample_id}", list(s.response_ids), s.reward,
                        policy_version=trainer.state.policy_version)
            for s in fixed
        ])  # fmt: skip
        collected = await trainer.intake.next_batch(
            trainer.state.policy_version, trainer.trained.__contains__, trainer.uncommitted,
            asyncio.Event(), block_ms=100,
        )  # fmt: skip
        report = await trainer.step(collected)
        assert report.figures["clip_frac"] == 0.0  # old log-probs recomputed: ratio 1 at start
        history.append(await mean_logp())
    await redis.aclose()

    deltas = torch.stack([after - before for before, after in itertools.pairwise(history)])
    positive, negative = rewards > 0, rewards < 0
    assert (deltas[:, positive] > 0).all(), deltas  # every step raised every positive response
    assert (deltas[:, negative] < 0).all(), deltas  # ...and lowered every negative one
    total = history[-1] - history[0]
    print(f"log-prob change after {ROUNDS} steps: {total.tolist()}, rewards {rewards.tolist()}")
