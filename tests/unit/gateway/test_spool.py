"""The recording spool: calls kept in order on disk, replayed oldest first, paused at the first
one Redis refuses again, reloaded by a restarted gateway, bounded."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from clawrl.gateway.spool import SPOOL_FILE, RecordingSpool, SpooledCall

ERRORS = (RedisConnectionError, OSError)


def call(n: int) -> SpooledCall:
    return SpooledCall("record", {"request_id": f"r{n}", "turn": bytes([n, 0, 255]),
                                  "prefixes": ["a", "b"], "arrived": 1.5 + n})  # fmt: skip


async def test_calls_replay_in_order_and_pause_at_the_first_refusal(tmp_path):
    spool = RecordingSpool(tmp_path, max_bytes=1 << 20)
    for n in range(5):
        assert spool.append(call(n))
    applied: list[SpooledCall] = []

    async def flaky(c: SpooledCall) -> None:
        if c.kwargs["request_id"] == "r3" and not applied[3:]:
            applied.append(c)  # reached once, then Redis goes away
            raise RedisConnectionError("down")
        applied.append(c)

    assert await spool.replay(flaky, ERRORS) == 3
    assert len(spool) == 2
    assert await spool.replay(flaky, ERRORS) == 2
    assert len(spool) == 0 and spool.bytes == 0
    ids = [c.kwargs["request_id"] for c in applied]
    assert ids == ["r0", "r1", "r2", "r3", "r3", "r4"]  # r3 again: the scripts are idempotent
    assert applied[0] == call(0)  # bytes, lists and floats survive the disk format


def tear(path) -> None:
    """A last line torn by a crash mid-write: its call was never counted as spooled."""
    with open(path, "ab") as f:
        f.write(b'{"op": "record", "kwa')


async def test_a_restarted_gateway_replays_what_the_last_one_spooled(tmp_path):
    first = RecordingSpool(tmp_path, max_bytes=1 << 20)
    for n in range(3):
        first.append(call(n))
    first.close()
    tear(tmp_path / SPOOL_FILE)
    second = RecordingSpool(tmp_path, max_bytes=1 << 20)
    assert len(second) == 3
    seen: list[SpooledCall] = []

    async def apply(c: SpooledCall) -> None:
        seen.append(c)

    assert await second.replay(apply, ERRORS) == 3
    assert seen == [call(0), call(1), call(2)]
    second.close()
    assert len(RecordingSpool(tmp_path, max_bytes=1 << 20)) == 0


def test_a_full_spool_refuses_and_writes_nothing(tmp_path):
    size = len(call(0).to_line())
    spool = RecordingSpool(tmp_path, max_bytes=2 * size)
    assert spool.append(call(0)) and spool.append(call(1))
    assert not spool.append(call(2))
    spool.close()
    assert len(RecordingSpool(tmp_path, max_bytes=2 * size)) == 2


def test_one_gateway_per_spool(tmp_path):
    first = RecordingSpool(tmp_path, max_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="held by another gateway"):
        RecordingSpool(tmp_path, max_bytes=1 << 20)
    first.close()
    RecordingSpool(tmp_path, max_bytes=1 << 20).close()
