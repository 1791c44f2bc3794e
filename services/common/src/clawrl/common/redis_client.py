"""The one way every service connects to Redis: one server (`redis.asyncio.Redis`) or, with
`[redis] cluster = true`, a Redis Cluster (`redis.asyncio.RedisCluster`, seeded by the URL's node),
with the same options; the Lua scripts the services run, alone or many calls in one pipeline."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from clawrl.common.settings import RedisSettings


def connect(settings: RedisSettings, **options: Any) -> Redis:
    """A client for `settings.url`: `options` are redis-py's (socket_timeout, retry, ...)."""
    if settings.cluster:
        return RedisCluster.from_url(settings.url, **options)  # type: ignore[return-value]
    return Redis.from_url(settings.url, **options)


def is_cluster(redis: Any) -> bool:
    return isinstance(redis, RedisCluster)


class Script:
    """A Lua script, run by its SHA1. A node that does not know it (its first use there; a node
    restarted, or a replica promoted by a failover) answers NOSCRIPT without running it, and is
    sent the source (EVAL), which runs it and caches it on that very node. redis-py's own reload
    (SCRIPT LOAD) goes to a node of the client's choosing: redis-py 7's cluster client loads it
    elsewhere than a promoted replica, and every call after the failover failed with NOSCRIPT."""

    def __init__(self, redis: Redis, source: str) -> None:
        self.redis = redis
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        try:
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.redis.eval(self.source, len(keys), *keys, *args)


async def run_script(redis: Redis, script: Script, calls: Sequence[tuple[list, list]]) -> list[Any]:
    """`script` once per `(keys, args)`, results in order, in one pipeline (one round trip per
    node, each node's calls run in order). A call a node refused with NOSCRIPT (it never ran)
    is run again on its own, which gives that node the script."""
    if not calls:
        return []
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
