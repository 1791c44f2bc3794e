"""redis_client.direct_command and Script(direct=True), the gateway's fast way to run its session
scripts, against a real Redis: the same replies as redis-py's own path, NOSCRIPT answered by
EVAL, a connection the server closed tried once more (by a script), an interrupted call never
leaving its reply for the next one, and a script call bounded by `timeout_s` on a client
without a socket timeout."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from clawrl.common.redis_client import Script, direct_command

pytestmark = pytest.mark.integration

ECHO = "return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1, {ARGV[3]}, redis.call('GET', KEYS[1])}"
# Busy for ARGV[1] milliseconds of Redis time, then returns ARGV[2].
SLOW = """
local t = redis.call('TIME')
local until_us = t[1] * 1000000 + t[2] + tonumber(ARGV[1]) * 1000
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= until_us
return ARGV[2]
"""


def client(redis_url: str) -> Redis:
    return Redis.from_url(redis_url, socket_timeout=None)  # as the gateway's recording client


async def test_direct_replies_are_redis_pys(redis_url):
    redis = client(redis_url)
    key = f"test:direct:{random.getrandbits(32):x}"
    try:
        await redis.set(key, b"v\r\n\x00")
        sha = await redis.script_load(ECHO)
        args = (key, "é", 41, b"\xff\r\n")
        expected = await redis.evalsha(sha, 1, *args)
        assert expected == [key.encode(), "é".encode(), 42, [b"\xff\r\n"], b"v\r\n\x00"]
        assert await direct_command(redis, "EVALSHA", sha, 1, *args) == expected
    finally:
        await redis.aclose()


async def test_noscript_is_answered_by_eval(redis_url):
    redis = client(redis_url)
    key = f"test:direct:{random.getrandbits(32):x}"
    script = Script(redis, ECHO + " -- " + key, direct=True)  # never loaded before
    try:
        assert script.direct
        assert (await script([key], ["a", 1, "b"]))[:3] == [key.encode(), b"a", 2]
        assert await redis.script_exists(script.sha) == [True]
        assert (await script([key], ["c", 2, "d"]))[:3] == [key.encode(), b"c", 3]
    finally:
        await redis.aclose()


async def test_a_connection_the_server_closed_is_tried_once_more_by_a_direct_script(redis_url):
    redis, admin = client(redis_url), Redis.from_url(redis_url)
    script = Script(redis, "return ARGV[1]", direct=True)
    try:
        assert await script(args=["before"]) == b"before"
        assert await admin.client_kill_filter(_type="normal", skipme=True) >= 1
        assert await script(args=["after"]) == b"after"  # on a new connection
        # direct_command alone sends once: the pooled connection the server closed fails.
        await direct_command(redis, "PING")
        assert await admin.client_kill_filter(_type="normal", skipme=True) >= 1
        with pytest.raises(RedisConnectionError):
            await direct_command(redis, "PING")
        assert await direct_command(redis, "PING") == b"PONG"
    finally:
        await redis.aclose()
        await admin.aclose()


async def test_an_interrupted_call_leaves_no_reply_behind(redis_url):
    redis = client(redis_url)
    try:
        slow = Script(redis, SLOW, direct=True)
        await slow(args=[1, "warm"])  # loaded: the next call goes by EVALSHA
        call = asyncio.create_task(slow(args=[300, "the slow reply"]))
        await asyncio.sleep(0.1)  # sent, and Redis is busy with it
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # The next call, on whatever pooled connection, reads its own reply only.
        assert await direct_command(redis, "ECHO", "mine") == b"mine"
        assert await direct_command(redis, "ECHO", "mine too") == b"mine too"
    finally:
        await redis.aclose()


async def test_a_script_call_is_bounded_by_its_timeout(redis_url):
    redis, other = client(redis_url), client(redis_url)
    try:
        slow = Script(other, SLOW, direct=True)
        await slow(args=[1, "warm"])
        busy = asyncio.create_task(slow(args=[600, "done"]))  # Redis runs one script at a time
        await asyncio.sleep(0.1)
        bounded = Script(redis, "return 1", direct=True, timeout_s=0.15)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await bounded()
        assert time.monotonic() - started < 0.45
        assert await busy == b"done"
        assert await bounded() == 1  # Redis free again: the same client goes on
    finally:
        await redis.aclose()
        await other.aclose()


async def test_a_direct_script_keeps_its_connections_and_gives_back_a_failed_one(redis_url):
    # The script holds the connections of its calls (past the pool's release and its
    # observability hooks): one a call at a time, two for two concurrent calls; a call cut by a
    # dropped connection leaves none behind that the server closed.
    redis, admin = client(redis_url), Redis.from_url(redis_url)
    script = Script(redis, "return ARGV[1]", direct=True)
    slow = Script(redis, SLOW, direct=True)
    try:
        for i in range(5):
            assert await script(args=[str(i)]) == str(i).encode()
        assert len(script._held) == 1
        assert len(redis.connection_pool._available_connections) == 0  # never went back
        await slow(args=[1, "warm"])
        assert await asyncio.gather(slow(args=[50, "a"]), slow(args=[50, "b"])) == [b"a", b"b"]
        assert len(slow._held) == 2
        assert await admin.client_kill_filter(_type="normal", skipme=True) >= 1
        assert await script(args=["after"]) == b"after"  # tried once more, on a live one
        assert len(script._held) == 1 and script._held[0].is_connected
    finally:
        await redis.aclose()
        await admin.aclose()
