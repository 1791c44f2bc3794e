"""The trainer service with `train.backend = megatron` at TP=2 (Ray actors, gloo) on a real Redis:
samples from the stream become a step, acknowledged, and a policy export transformers loads."""

from __future__ import annotations

import pytest
import ray
import torch
from redis.asyncio import Redis
from transformers import AutoModelForCausalLM

from clawrl.trainer.driver import start_backend
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.service import build_trainer
from tests.integration.trainer.helpers import make_sample, pending, publish_all, settings_for
from tests.integration.trainer.test_trainer_stream import one_step

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_the_trainer_steps_and_exports_with_the_megatron_backend(redis_url, tmp_path):
    settings = settings_for(redis_url, tmp_path, train={"backend": "megatron", "device": "cpu"},
                            megatron={"tensor_parallel_size": 2})  # fmt: skip
    redis = Redis.from_url(redis_url)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer = await build_trainer(settings, start_backend(settings), redis, TrainerMetrics())
        samples = [make_sample(f"m:{i}", [40 + i, 50 + i, 60 + i], reward=(-1) ** i)
                   for i in range(4)]  # fmt: skip
        await publish_all(redis, settings, samples)
        report = await one_step(trainer)
        assert report.sample_ids == tuple(s.sample_id for s in samples)
        assert report.exported and report.policy_version == 1
        assert await pending(redis, settings) == 0
        export = trainer.store.policies / "v1"
        model = AutoModelForCausalLM.from_pretrained(export)
        assert model.config.num_attention_heads == 4
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        ray.shutdown()
        await redis.aclose()
