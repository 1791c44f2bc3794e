"""The one way every service connects to Redis: one server (`redis.asyncio.Redis`) or, with
`[redis] cluster = true`, a Redis Cluster (`redis.asyncio.RedisCluster`, seeded by the URL's node),
with the same options; and running many calls of one script in one pipeline on either."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from clawrl.common.settings import RedisSettings


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
    """`script` once per `(keys, args)`, results in order, in one pipeline (one round trip per
    node, each node's calls run in order). redis-py refuses `evalsha` in a cluster pipeline, as a
    node that does not know the script would answer NOSCRIPT: its calls are sent as plain
    EVALSHA commands, and any call a node refused so (it never ran) is run again on its own,
    which loads the script."""
    if not calls:
        return []
    if not is_cluster(redis):
        async with redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                await script(keys=keys, args=args, client=pipe)
            return await pipe.execute()
    async with redis.pipeline(transaction=False) as pipe:
        for keys, args in calls:
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        results = await pipe.execute(raise_on_error=False)
    for i, result in enumerate(results):
        if isinstance(result, NoScriptError):
            keys, args = calls[i]
            results[i] = await script(keys=keys, args=args)
        elif isinstance(result, Exception):
            raise result
    return results
