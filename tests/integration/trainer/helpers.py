"""Shared pieces of the trainer's integration tests: samples on a real stream, settings with
their own stream names, a trainer around the in-process PyTorch backend."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from redis.asyncio import Redis

from clawrl.common.proto.records_pb2 import SampleMode
from clawrl.common.records import Sample
from clawrl.common.streams import publish
from clawrl.trainer.driver import InProcess
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.service import build_trainer
from clawrl.trainer.settings import TrainerSettings
from clawrl.trainer.torch_backend import TorchBackend
from clawrl.trainer.training import Trainer

PROMPT = [1, 504, 3458, 282, 4649, 314, 2]


def make_sample(sample_id: str, response: list[int], reward: float = 1.0, **overrides) -> Sample:
    fields = dict(
        sample_id=sample_id, session_id=sample_id.split(":")[0],
        prompt_ids=PROMPT, response_ids=response, old_logprobs=[-10.0] * len(response),
        loss_mask=[1.0] * len(response), reward=reward, policy_version=0,
        mode=SampleMode.SAMPLE_MODE_BINARY_RL,  # what the default estimator (grpo) trains
    )  # fmt: skip
    fields.update(overrides)
    return Sample(**fields)


def settings_for(redis_url: str, checkpoint_dir: Path, **sections) -> TrainerSettings:
    """Settings on this test's own streams, the tiny model, batches of 4 by default."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    base = {
        "model": {"path": "smollm2-tiny"},
        "redis": {
            "url": redis_url,
            "samples_stream": f"{prefix}:samples",
            "deadletter_stream": f"{prefix}:dead",
            "versions_stream": f"{prefix}:versions",
        },
        "rollout": {"rollout_batch_size": 4},
        "ppo": {"lr": 1e-4},
        "consumer": {"block_ms": 100},
        "checkpoint": {"dir": checkpoint_dir},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return TrainerSettings(**base)


async def start_trainer(
    settings: TrainerSettings,
    redis: Redis,
    metrics: TrainerMetrics | None = None,
    stop: asyncio.Event | None = None,
) -> Trainer:
    backend = InProcess(TorchBackend(settings.train, settings.ppo, settings.model, settings.lora))
    return await build_trainer(settings, backend, redis, metrics or TrainerMetrics(), stop)


async def publish_all(redis: Redis, settings: TrainerSettings, samples: list[Sample]) -> None:
    for sample in samples:
        await publish(redis, settings.redis.samples_stream, sample, maxlen=10_000)


async def pending(redis: Redis, settings: TrainerSettings) -> int:
    summary = await redis.xpending(settings.redis.samples_stream, settings.consumer.group)
    return int(summary["pending"])


def counter(trainer: Trainer, name: str, **labels) -> float:
    value = trainer.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0
