"""The one way every service connects to Redis: one server (`redis.asyncio.Redis`) or, with
`[redis] cluster = true`, a Redis Cluster (`redis.asyncio.RedisCluster`, seeded by the URL's node),
with the same options; the Lua scripts the services run, alone or many calls in one pipeline."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from clawrl.common.settings import RedisSettings

# What an unavailable or failing-over Redis raises. RedisClusterException is no RedisError: a
# cluster client rebuilding its slot map after a failover raises it ("All slots are not
# covered", no reachable node), and a loop that missed it died there.
REDIS_ERRORS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)

try:
    from hiredis import pack_command as hiredis_pack
except ImportError:  # redis-py's own parser then, and pack_command in Python
    hiredis_pack = None


def connect(settings: RedisSettings, **options: Any) -> Redis:
    """A client for `settings.url`: `options` are redis-py's (socket_timeout, retry, ...)."""
    if settings.cluster:
        return RedisCluster.from_url(settings.url, **options)  # type: ignore[return-value]
    return Redis.from_url(settings.url, **options)


def is_cluster(redis: Any) -> bool:
    return isinstance(redis, RedisCluster)


def pack_command(*args: Any) -> bytes:
    """A command in Redis's protocol (RESP), its arguments encoded as redis-py encodes them
    (bytes as they are, str as UTF-8, int and float by repr), in one bytes object. By hiredis's
    C packer when it is installed (~4 us for a session script's 27 arguments, ~16 in Python)."""
    if hiredis_pack is not None:
        try:
            return hiredis_pack(args)
        except TypeError:
            pass  # the same refusal as below, with its message
    return _pack_in_python(args)


def _pack_in_python(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, bool) or not isinstance(arg, (bytes, int, float)):
            raise TypeError(f"a Redis argument must be bytes, str, int or float, not {arg!r}")
        elif not isinstance(arg, bytes):
            arg = repr(arg).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
    return b"".join(out)


async def direct_command(redis: Redis, *args: Any, held: list | None = None) -> Any:
    """One command on a connection of `redis`'s pool, sent once, past redis-py's per-command
    layers: its observability hooks and response callbacks (the reply is the raw one; EVAL and
    EVALSHA have none), the task `asyncio.wait_for` starts for every send of a client with a
    socket timeout (a client without one, bounded by its caller, saves two passes of the event
    loop a call), and `get_connection`'s poll of the socket for data left over (a timer and a
    cancelled read: two passes more). None is left over: redis-py closes a connection whose send
    or read was interrupted, as it would be here. A connection the server closed fails the read
    with a ConnectionError; nothing is retried here (see Script).
    `held`: connections the caller keeps between calls (taken from the pool, still counted in
    use there, closed with it), which skips the pool's release and its observability hooks
    (~7 us a call); a call that fails gives its connection back to the pool instead."""
    command = pack_command(*args)
    pool = redis.connection_pool
    conn = held.pop() if held else pool.get_available_connection()
    try:
        await conn.send_packed_command(command)
        reply = await conn.read_response()
    except BaseException:
        await pool.release(conn)
        raise
    if held is None:
        await pool.release(conn)
    else:
        held.append(conn)
    return reply


class Script:
    """A Lua script, run by its SHA1. A node that does not know it (its first use there; a node
    restarted, or a replica promoted by a failover) answers NOSCRIPT without running it, and is
    sent the source (EVAL), which runs it and caches it on that very node. redis-py's own reload
    (SCRIPT LOAD) goes to a node of the client's choosing: redis-py 7's cluster client loads it
    elsewhere than a promoted replica, and every call after the failover failed with NOSCRIPT.
    `direct`: calls go by direct_command (one Redis server, no cluster), for a hot path; a call
    cut by a connection error (a pooled connection the server had closed, a server restarted) is
    sent once more on a new connection, so a direct script must be idempotent (the gateway's
    session scripts are, by request id). `timeout_s` bounds each call, both tries (for a client
    made without a socket timeout)."""

    def __init__(
        self, redis: Redis, source: str, *, direct: bool = False, timeout_s: float | None = None
    ) -> None:
        self.redis = redis
        self.timeout_s = timeout_s
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        # A cluster client routes by key slot, and a single-connection client has no pool.
        self.direct = direct and isinstance(redis, Redis) and redis.connection is None
        self._held: list = []  # connections kept for the direct calls (direct_command)

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        async with asyncio.timeout(self.timeout_s):
            return await self._run(keys, args)

    async def _run(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            if not self.direct:
                return await self.redis.evalsha(self.sha, len(keys), *keys, *args)
            command = ("EVALSHA", self.sha, len(keys), *keys, *args)
            try:
                return await direct_command(self.redis, *command, held=self._held)
            except RedisConnectionError:
                return await direct_command(self.redis, *command, held=self._held)
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
