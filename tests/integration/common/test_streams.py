"""The consumer-group layer every stream consumer uses, against a real Redis: at-least-once
delivery, takeover of a dead consumer's entries, dead-lettering, and trimming only what every
group has acknowledged."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from clawrl.common.records import Turn, encode_entry
from clawrl.common.streams import GroupConsumer, publish, trim_acknowledged
from clawrl.common.versions import VersionReady, announce, latest

pytestmark = pytest.mark.integration


@pytest.fixture
async def redis(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def consumer(redis: Redis, stream: str, name: str, **kwargs) -> GroupConsumer:
    return GroupConsumer(
        redis,
        stream=stream,
        group="g",
        consumer=name,
        deadletter_stream=f"{stream}:dead",
        **kwargs,
    )


async def fill(redis: Redis, stream: str, n: int) -> None:
    for i in range(n):
        await publish(redis, stream, Turn(turn_id=f"s:{i}", session_id="s", turn_index=i), 1000)


async def test_new_entries_are_delivered_once_and_acknowledged(redis: Redis):
    stream = f"t:{uuid.uuid4().hex}"
    a = consumer(redis, stream, "a")
    await a.ensure_group()
    await a.ensure_group()  # idempotent
    await fill(redis, stream, 3)
    entries = await a.read(10, block_ms=10)
    assert [e.record_id for e in entries] == ["s:0", "s:1", "s:2"]
    assert await a.read(10, block_ms=10) == []
    await a.ack(*(e.entry_id for e in entries))
    assert (await redis.xpending(stream, "g"))["pending"] == 0


async def test_a_dead_consumers_entries_are_claimed_by_a_live_one(redis: Redis):
    stream = f"t:{uuid.uuid4().hex}"
    dead = consumer(redis, stream, "dead", claim_idle_ms=50)
    live = consumer(redis, stream, "live", claim_idle_ms=50)
    await dead.ensure_group()
    await fill(redis, stream, 2)
    assert len(await dead.read(10, block_ms=10)) == 2  # and never acknowledged
    # Not idle long enough yet: checked with a long claim_idle_ms, as a loaded host can take
    # longer than 50 ms between the two reads.
    patient = consumer(redis, stream, "patient", claim_idle_ms=5_000)
    assert await patient.read(10, block_ms=10) == []
    await asyncio.sleep(0.1)
    taken = await live.read(10, block_ms=10)
    assert [e.record_id for e in taken] == ["s:0", "s:1"]
    assert all(e.deliveries == 2 for e in taken)


async def test_an_entry_delivered_too_often_goes_to_the_dead_letter_stream(redis: Redis):
    stream = f"t:{uuid.uuid4().hex}"
    workers = [
        consumer(redis, stream, f"w{i}", claim_idle_ms=1, max_deliveries=2) for i in range(3)
    ]
    await workers[0].ensure_group()
    await fill(redis, stream, 1)
    assert len(await workers[0].read(1, block_ms=10)) == 1
    await asyncio.sleep(0.01)
    assert len(await workers[1].read(1, block_ms=10)) == 1  # second delivery
    await asyncio.sleep(0.01)
    assert await workers[2].read(1, block_ms=10) == []  # third: dead-lettered instead
    dead = await redis.xrange(f"{stream}:dead")
    assert len(dead) == 1
    assert dead[0][1][b"id"] == b"s:0"
    assert b"delivered 3 times" in dead[0][1][b"reason"]
    assert (await redis.xpending(stream, "g"))["pending"] == 0


async def test_dead_letter_keeps_the_record_and_the_reason(redis: Redis):
    stream = f"t:{uuid.uuid4().hex}"
    c = consumer(redis, stream, "a")
    await c.ensure_group()
    await fill(redis, stream, 1)
    [entry] = await c.read(1, block_ms=10)
    await c.dead_letter(entry, "malformed: no response ids")
    [(_, fields)] = await redis.xrange(f"{stream}:dead")
    assert fields[b"reason"] == b"malformed: no response ids"
    assert fields[b"data"] == entry.fields[b"data"]
    assert fields[b"source_entry"] == entry.entry_id.encode()
    assert (await redis.xpending(stream, "g"))["pending"] == 0


async def test_trimming_keeps_what_any_group_still_needs(redis: Redis):
    stream = f"t:{uuid.uuid4().hex}"
    fast = GroupConsumer(redis, stream=stream, group="fast", consumer="f",
                         deadletter_stream=f"{stream}:dead")  # fmt: skip
    slow = GroupConsumer(redis, stream=stream, group="slow", consumer="s",
                         deadletter_stream=f"{stream}:dead")  # fmt: skip
    await fast.ensure_group()
    await slow.ensure_group()
    await fill(redis, stream, 6)
    done = await fast.read(6, block_ms=10)
    await fast.ack(*(e.entry_id for e in done))
    slow_entries = await slow.read(2, block_ms=10)  # pending, not acknowledged
    assert await trim_acknowledged(redis, stream, approximate=False) == 0
    assert await redis.xlen(stream) == 6
    await slow.ack(slow_entries[0].entry_id)
    assert await trim_acknowledged(redis, stream, approximate=False) == 1
    remaining = [fields[b"id"] for _, fields in await redis.xrange(stream)]
    assert remaining == [b"s:1", b"s:2", b"s:3", b"s:4", b"s:5"]
    await slow.ack(slow_entries[1].entry_id)
    # A retention floor keeps entries at or above it even when every group is done with them.
    floor = (await redis.xrange(stream))[2][0].decode()  # s:3
    assert await trim_acknowledged(redis, stream, floor, approximate=False) == 1
    assert await redis.xlen(stream) == 4
    assert await trim_acknowledged(redis, stream, approximate=False) == 0  # s:2.. still unread


async def test_version_announcements_round_trip(redis: Redis):
    stream = f"v:{uuid.uuid4().hex}"
    assert await latest(redis, stream) is None
    await announce(redis, stream, VersionReady(1, "/ckpt/policy/v1", 4, 1.5))
    await announce(redis, stream, VersionReady(2, "/ckpt/policy/v2", 8, 2.5))
    assert await latest(redis, stream) == VersionReady(2, "/ckpt/policy/v2", 8, 2.5)
    with pytest.raises(ValueError, match="malformed"):
        VersionReady.from_fields({b"path": b"/x"})


async def test_a_restarted_consumer_reads_its_own_pending_entries_first(redis: Redis) -> None:
    stream = f"own-{uuid.uuid4().hex}"
    first = consumer(redis, stream, "c")
    await first.ensure_group()
    await fill(redis, stream, 3)
    taken = await first.read(2)
    assert [e.record_id for e in taken] == ["s:0", "s:1"]
    await first.ack(taken[0].entry_id)
    # Same name after a restart: its unacknowledged entry comes back at once, not after idling.
    again = consumer(redis, stream, "c", claim_idle_ms=3_600_000)
    assert [e.record_id for e in await again.read_own_pending(10)] == ["s:1"]
    assert [e.record_id for e in await again.read(10, block_ms=10)] == ["s:2"]
    assert await consumer(redis, stream, "other").read_own_pending(10) == []


async def test_delivery_counts_are_read_by_numeric_entry_id(redis: Redis) -> None:
    # Ids 1-0 .. 1-11: as strings "1-10" < "1-9", which once cut the entries after 1-9 out of
    # the XPENDING range, so they counted as first deliveries and were never dead-lettered.
    stream = f"t:{uuid.uuid4().hex}"
    first, second, third = (
        consumer(redis, stream, name, claim_idle_ms=20, max_deliveries=2) for name in "abc"
    )
    await first.ensure_group()
    for i in range(12):
        turn = Turn(turn_id=f"s:{i}", session_id="s", turn_index=i)
        await redis.xadd(stream, encode_entry(turn), id=f"1-{i}")
    assert len(await first.read(12, block_ms=10)) == 12  # first delivery, never acknowledged
    await asyncio.sleep(0.05)
    taken = await second.read(12, block_ms=10)
    assert [e.deliveries for e in taken] == [2] * 12
    await asyncio.sleep(0.05)
    assert await third.read(12, block_ms=10) == []  # third delivery: all dead-lettered
    dead = await redis.xrange(f"{stream}:dead")
    assert [fields[b"source_entry"] for _, fields in dead] == [f"1-{i}".encode() for i in range(12)]
    assert all(b"delivered 3 times" in fields[b"reason"] for _, fields in dead)
    assert (await redis.xpending(stream, "g"))["pending"] == 0


async def test_a_consumer_never_claims_what_it_still_holds(redis: Redis) -> None:
    stream = f"t:{uuid.uuid4().hex}"
    c = consumer(redis, stream, "c", claim_idle_ms=20, max_deliveries=2)
    await c.ensure_group()
    await fill(redis, stream, 1)
    [held] = await c.read(1, block_ms=10)
    for _ in range(4):  # held far past claim_idle_ms (a half-filled batch, a long step)
        await asyncio.sleep(0.05)
        assert await c.read(1, block_ms=10) == []
    [row] = await redis.xpending_range(stream, "g", min="-", max="+", count=10)
    assert row["times_delivered"] == 1
    assert await redis.xlen(f"{stream}:dead") == 0
    # Released (its work failed), it is taken over once idle, as its second delivery.
    c.release(held.entry_id)
    await asyncio.sleep(0.05)
    [again] = await c.read(1, block_ms=10)
    assert (again.entry_id, again.deliveries) == (held.entry_id, 2)
    # A live consumer's entries are not another's to take while they are fresh; a dead one's are.
    # (Fresh checked with a long claim_idle_ms: a loaded host can take 20 ms between reads.)
    assert await consumer(redis, stream, "patient", claim_idle_ms=5_000).read(1, block_ms=10) == []
    other = consumer(redis, stream, "other", claim_idle_ms=20)
    await asyncio.sleep(0.05)
    [taken] = await other.read(1, block_ms=10)
    assert (taken.entry_id, taken.deliveries) == (held.entry_id, 3)


async def test_claiming_pages_past_held_entries(redis: Redis) -> None:
    stream = f"t:{uuid.uuid4().hex}"
    c = consumer(redis, stream, "c", claim_idle_ms=20)
    await c.ensure_group()
    await fill(redis, stream, 5)
    entries = await c.read(5, block_ms=10)
    c.release(entries[3].entry_id, entries[4].entry_id)  # the first three stay held
    await asyncio.sleep(0.05)
    assert [e.record_id for e in await c.claim(2)] == ["s:3", "s:4"]


async def test_entries_of_a_lost_read_reply_are_taken_back_within_seconds(redis: Redis) -> None:
    """A read whose reply a dropped connection lost (Redis delivered, the client never saw it,
    redis-py's retry read on): its entries are pending on the consumer, which does not hold
    them. They come back at the next sweep, not after claim_idle_ms (here an hour)."""
    stream = f"t:{uuid.uuid4().hex}"
    c = consumer(redis, stream, "c", claim_idle_ms=3_600_000, sweep_interval_s=0.5)
    await c.ensure_group()
    await fill(redis, stream, 4)
    assert [e.record_id for e in await c.read(1, block_ms=10)] == ["s:0"]  # held
    await redis.xreadgroup("g", "c", {stream: ">"}, count=2)  # s:1, s:2: the lost reply
    assert [e.record_id for e in await c.read(1, block_ms=10)] == ["s:3"]  # not yet swept
    assert await c.read(10, block_ms=10) == []
    await asyncio.sleep(1.1)  # idle past STRAY_IDLE_MS, past the sweep interval
    taken = await c.read(10, block_ms=10)
    assert [(e.record_id, e.deliveries) for e in taken] == [("s:1", 2), ("s:2", 2)]
    await asyncio.sleep(1.1)
    assert await c.read(10, block_ms=10) == []  # held now, never taken twice


async def test_a_lost_acknowledgement_is_swept_but_a_failure_waits_for_claim_idle(
    redis: Redis,
) -> None:
    """The judge commits a turn in a script that XACKs it, then stops holding it; a failover can
    lose that XACK (the old primary answered, its replica never had it), leaving the turn
    pending and unjudged: a stray, back within seconds. A turn whose judging failed is released
    to wait `claim_idle_ms` (the retry's back-off): no stray."""
    stream = f"t:{uuid.uuid4().hex}"
    c = consumer(redis, stream, "c", claim_idle_ms=3_600_000, sweep_interval_s=0.5)
    await c.ensure_group()
    await fill(redis, stream, 3)
    failed, lost, done = await c.read(3, block_ms=10)
    c.release(failed.entry_id)
    c.forget(lost.entry_id)  # acknowledged in a script whose XACK never reached the new primary
    await redis.xack(stream, "g", done.entry_id)
    c.release(done.entry_id)  # acknowledged, then released: pruned at the next sweep
    await asyncio.sleep(1.1)
    taken = await c.read(10, block_ms=10)
    assert [(e.entry_id, e.deliveries) for e in taken] == [(lost.entry_id, 2)]
    assert c.released == {failed.entry_id}
