"""redis_client.pack_command: the bytes redis-py itself would send for the same arguments."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection

from clawrl.common import redis_client
from clawrl.common.redis_client import pack_command


def redis_py_bytes(*args) -> bytes:
    return b"".join(Connection().pack_command(*args))


@pytest.mark.parametrize(
    "args",
    [
        ("PING",),
        ("EVALSHA", "ab" * 20, 2, "k1", "k2", 0, -7, 12345678901234),
        ("SET", "clé ✓", b"line\r\nbreak\x00byte", 0.1, 1e-7, 1.7e308, -0.0),
        ("SET", "big", b"x" * 70_000),  # past redis-py's size at which it splits a command
        ("HSET", "h", "", b""),
    ],
)
def test_same_bytes_as_redis_py(args, monkeypatch):
    assert redis_client.hiredis_pack is not None  # a declared dependency: the fast path
    assert pack_command(*args) == redis_py_bytes(*args)
    monkeypatch.setattr(redis_client, "hiredis_pack", None)  # without hiredis
    assert pack_command(*args) == redis_py_bytes(*args)


@pytest.mark.parametrize("bad", [True, None, [1], {"a": 1}])
def test_other_types_are_refused(bad):
    with pytest.raises(TypeError, match="bytes, str, int or float"):
        pack_command("SET", "k", bad)
