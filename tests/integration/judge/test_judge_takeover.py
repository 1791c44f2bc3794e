"""A killed judge worker's turn is finished by another: the worker (a real `clawrl-judge`
process) is SIGKILLed while it holds a turn; a live worker claims the entry after the idle
time and publishes its one sample."""

from __future__ import annotations

import asyncio
import sys

import pytest
from redis.asyncio import Redis

from clawrl.judge.service import running
from tests.conftest import ChildProcess

from .helpers import judge_settings, make_turn, pending, put_turns, said, wait_samples

pytestmark = pytest.mark.integration


async def consumer_pending(redis: Redis, stream: str, group: str) -> dict[str, int]:
    return {
        c["name"].decode(): int(c["pending"]) for c in await redis.xinfo_consumers(stream, group)
    }


async def test_a_killed_workers_pending_turn_is_finished_by_another(
    redis: Redis, redis_url: str, log_dir
) -> None:
    settings = judge_settings(
        redis_url,
        judging={"reward_fn": "tests.integration.judge.plugins:by_response"},
        workers={"claim_idle_ms": 500, "consumer": "rescuer"},
    )
    r, w = settings.redis, settings.workers
    env = {
        "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
        "CLAWRL_REDIS__URL": redis_url,
        "CLAWRL_REDIS__TURNS_STREAM": r.turns_stream,
        "CLAWRL_REDIS__SAMPLES_STREAM": r.samples_stream,
        "CLAWRL_REDIS__DEADLETTER_STREAM": r.deadletter_stream,
        "CLAWRL_AUDIT__STREAM": settings.audit.stream,
        "CLAWRL_WORKERS__KEY_PREFIX": w.key_prefix,
        "CLAWRL_WORKERS__CONSUMER": "doomed",
        "CLAWRL_JUDGING__REWARD_FN": "tests.integration.judge.plugins:never",
        "CLAWRL_BACKEND__ENGINE_URL": "",
    }
    await put_turns(redis, settings, [make_turn("k", 0, response="+1", next_state=said("ok"))])
    child = ChildProcess(
        "judge-doomed",
        [sys.executable, "-m", "clawrl.judge.main", "--grpc-port", "0", "--metrics-port", "0"],
        log_dir,
        env=env,
    )
    try:
        for _ in range(600):
            groups = await redis.xinfo_groups(r.turns_stream)
            if groups and (await consumer_pending(redis, r.turns_stream, w.group)).get("doomed"):
                break
            assert child.proc.poll() is None, child.log_tail()
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"the worker never took the turn:\n{child.log_tail()}")
        child.proc.kill()
        child.proc.wait()
    finally:
        child.stop()
    assert await pending(redis, settings) == 1
    async with running(settings, serve=False):
        (sample,) = await wait_samples(redis, settings, 1)
        await asyncio.sleep(0.3)
        left = await consumer_pending(redis, r.turns_stream, w.group)
    assert sample.sample_id == "k:0" and sample.reward == 1.0
    assert left.get("doomed", 0) == 0 and await pending(redis, settings) == 0
    assert await redis.xlen(r.deadletter_stream) == 0
