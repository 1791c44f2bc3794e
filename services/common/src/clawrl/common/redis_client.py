"""The one way every service connects to Redis: one server (`redis.asyncio.Redis`) or, with
`[redis] cluster = true`, a Redis Cluster (`redis.asyncio.RedisCluster`, seeded by the URL's node),
with the same options; and running many calls of one script, which the cluster client cannot
pipeline."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from clawrl.common.settings import RedisSettings

# Both clients serve the same commands; code that needs the difference checks `is_cluster`.
AnyRedis = Redis | RedisCluster

# Script calls in flight at once on a cluster (each its own request: no pipelining there).
CLUSTER_SCRIPT_CONCURRENCY = 64


def connect(settings: RedisSettings, **options: Any) -> Redis:
    """A client for `settings.url`: `options` are redis-py's (socket_timeout, retry, ...)."""
    if settings.cluster:
        return RedisCluster.from_url(settings.url, **options)  # type: ignore[return-value]
    return Redis.from_url(settings.url, **options)


def is_cluster(redis: Any) -> bool:
    return isinstance(redis, RedisCluster)


async def run_script(
    redis: Redis, script: AsyncScript, calls: Sequence[tuple[list, list]]
) -> list[Any]:
    """`script` once per `(keys, args)`, results in order: in one pipeline on one Redis (one
    round trip), concurrently on a cluster (whose client refuses scripts in pipelines)."""
    if not calls:
        return []
    if not is_cluster(redis):
        async with redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                await script(keys=keys, args=args, client=pipe)
            return await pipe.execute()
    gate = asyncio.Semaphore(CLUSTER_SCRIPT_CONCURRENCY)

    async def one(keys: list, args: list) -> Any:
        async with gate:
            return await script(keys=keys, args=args)

    return list(await asyncio.gather(*(one(keys, args) for keys, args in calls)))
