"""The judge's housekeeping on a real Redis: the audit stream is bounded by age (its entries
carry replies and votes of up to ~20k characters, so a count alone does not bound Redis's
memory), and Redis's memory use and limit are exported for alerting."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from clawrl.common.streams import GroupConsumer
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.settings import RetentionSettings
from clawrl.judge.worker import age_floor, housekeeping

pytestmark = pytest.mark.integration


def test_age_floor_is_the_id_of_the_oldest_kept_millisecond():
    assert age_floor(1000.0, 10.0) == "990000-0"
    assert age_floor(5.0, 10.0) == "0-0"  # never a negative id


async def test_audit_records_older_than_audit_keep_s_are_trimmed_and_memory_is_exported(redis):
    prefix = f"hk-{uuid.uuid4().hex[:8]}"
    audit = f"{prefix}:audit"
    now_ms = int(time.time() * 1000)
    day_ms = 24 * 3600 * 1000
    # Explicit ids place entries in time: two weeks, eight days and one hour old, and new.
    for age_ms in (14 * day_ms, 8 * day_ms, 3600 * 1000):
        await redis.xadd(audit, {"record": "x" * 100}, id=f"{now_ms - age_ms}-0")
    recent = await redis.xadd(audit, {"record": "new"})
    consumer = GroupConsumer(
        redis, stream=f"{prefix}:turns", group="judges", consumer="c1",
        deadletter_stream=f"{prefix}:dead",
    )  # fmt: skip
    await consumer.ensure_group()
    metrics = JudgeMetrics()
    stop = asyncio.Event()
    settings = RetentionSettings(interval_s=30.0, audit_keep_s=7 * 24 * 3600.0)
    task = asyncio.create_task(
        housekeeping(redis, consumer, {}, metrics, settings, stop, audit_stream=audit)
    )

    def gauge(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    for _ in range(100):
        if gauge("clawrl_judge_redis_used_memory_bytes"):
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task

    assert gauge("clawrl_judge_redis_used_memory_bytes") > 0
    assert gauge("clawrl_judge_redis_maxmemory_bytes") == float(
        (await redis.info("memory"))["maxmemory"]
    )
    kept = [entry_id for entry_id, _ in await redis.xrange(audit)]
    # The two entries older than 7 days are gone; the hour-old one and the new one stay.
    assert len(kept) == 2
    assert kept[-1] == recent
    assert (
        metrics.registry.get_sample_value("clawrl_judge_trimmed_entries_total", {"stream": "audit"})
        == 2
    )
