"""A consumer over every shard of a stream (ShardedConsumer, what the trainer reads the sample
shards with), against a real Redis with 3 shards: each entry delivered once whatever shard it is
in, shards whose streams hold the same entry id kept apart, acknowledgement, dead letters into
the entry's own shard, a restart taking back its own pending entries of every shard, and a
blocking read woken by any shard."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from clawrl.common.records import Sample, encode_entry
from clawrl.common.shards import Shards
from clawrl.common.streams import ShardedConsumer, consumer_over

pytestmark = pytest.mark.integration

SHARDS = Shards(3)


@pytest.fixture
async def redis(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def sharded(redis: Redis, stream: str, name: str = "c1", **options) -> ShardedConsumer:
    consumer = consumer_over(redis, SHARDS, stream=stream, deadletter_stream=f"{stream}:dead",
                             group="g", consumer=name, **options)  # fmt: skip
    assert isinstance(consumer, ShardedConsumer)
    return consumer


async def add(redis: Redis, stream: str, shard: int, sample_id: str, entry_id: str = "*") -> None:
    fields = encode_entry(Sample(sample_id=sample_id))
    await redis.xadd(SHARDS.name(stream, shard), fields, id=entry_id)


async def test_every_shards_entries_are_delivered_once_even_with_equal_ids(redis: Redis):
    stream = f"t:{uuid.uuid4().hex}"
    consumer = sharded(redis, stream)
    await consumer.ensure_group()
    for shard in range(3):  # the same stream id in every shard: three different entries
        await add(redis, stream, shard, f"x{shard}", entry_id="1-1")
        await add(redis, stream, shard, f"y{shard}")
    entries = await consumer.read(4, block_ms=10)
    entries += await consumer.read(10, block_ms=10)
    assert sorted(e.record_id for e in entries) == ["x0", "x1", "x2", "y0", "y1", "y2"]
    assert len({e.entry_id for e in entries}) == 6
    assert await consumer.read(10, block_ms=10) == []
    await consumer.ack(*(e.entry_id for e in entries))
    for name in SHARDS.names(stream):
        assert (await redis.xpending(name, "g"))["pending"] == 0
        assert (await redis.xinfo_groups(name))[0]["entries-read"] == 2


async def test_a_dead_letter_goes_to_its_own_shard_with_the_reason(redis: Redis):
    stream = f"t:{uuid.uuid4().hex}"
    consumer = sharded(redis, stream)
    await consumer.ensure_group()
    await add(redis, stream, 2, "bad")
    (entry,) = await consumer.read(10, block_ms=10)
    await consumer.dead_letter(entry, "malformed")
    dead = await redis.xrange(SHARDS.name(f"{stream}:dead", 2))
    assert [(f[b"id"], f[b"reason"], f[b"source_stream"]) for _, f in dead] == [
        (b"bad", b"malformed", SHARDS.name(stream, 2).encode())
    ]
    assert (await redis.xpending(SHARDS.name(stream, 2), "g"))["pending"] == 0


async def test_a_restart_takes_back_its_own_pending_entries_of_every_shard(redis: Redis):
    stream = f"t:{uuid.uuid4().hex}"
    first = sharded(redis, stream)
    await first.ensure_group()
    for shard in range(3):
        await add(redis, stream, shard, f"s{shard}")
    held = await first.read(10, block_ms=10)
    await first.ack(held[0].entry_id)
    again = sharded(redis, stream)  # the same consumer name, restarted
    back = await again.read_own_pending(100)
    assert sorted(e.entry_id for e in back) == sorted(e.entry_id for e in held[1:])
    assert all(e.added_s > 0 for e in back)


async def test_a_blocking_read_wakes_for_an_entry_on_any_shard(redis: Redis):
    stream = f"t:{uuid.uuid4().hex}"
    consumer = sharded(redis, stream)
    await consumer.ensure_group()
    started = time.monotonic()
    assert await consumer.read(5, block_ms=300) == []
    assert time.monotonic() - started >= 0.25  # it blocked (split between the shards)

    async def later() -> None:
        await asyncio.sleep(0.05)
        await add(redis, stream, 1, "late")

    task = asyncio.create_task(later())
    entries: list = []
    while not entries:
        entries = await consumer.read(5, block_ms=300)
    await task
    assert [e.record_id for e in entries] == ["late"]
    assert entries[0].entry_id.startswith("1/")


async def test_a_dead_consumers_entries_are_claimed_shard_by_shard(redis: Redis):
    """What a dead trainer held in any shard is taken over once idle, as one more delivery,
    and dead-lettered into its shard past max_deliveries."""
    stream = f"t:{uuid.uuid4().hex}"
    dead = sharded(redis, stream, "dead", claim_idle_ms=50, max_deliveries=2)
    await dead.ensure_group()
    for shard in range(3):
        await add(redis, stream, shard, f"s{shard}")
    assert len(await dead.read(10, block_ms=10)) == 3
    live = sharded(redis, stream, "live", claim_idle_ms=50, max_deliveries=2)
    await asyncio.sleep(0.1)
    taken = await live.read(10, block_ms=10)
    assert sorted(e.record_id for e in taken) == ["s0", "s1", "s2"]
    assert {e.deliveries for e in taken} == {2}
    live.release(*(e.entry_id for e in taken))  # its work failed: pending, idle again
    await asyncio.sleep(0.1)
    assert await live.read(10, block_ms=10) == []  # a third delivery: dead-lettered instead
    for shard in range(3):
        letters = await redis.xrange(SHARDS.name(f"{stream}:dead", shard))
        assert [f[b"id"] for _, f in letters] == [f"s{shard}".encode()]
        assert (await redis.xpending(SHARDS.name(stream, shard), "g"))["pending"] == 0


async def test_a_shard_failing_after_another_delivered_loses_nothing(redis: Redis):
    """Shard 1 fails mid-read (its stream gone: NOGROUP, as after a failover that lost it) after
    shard 0 delivered: shard 0's entries are handed out, not left held where no read, claim or
    sweep would ever give them back; the error comes with the next read."""
    stream = f"t:{uuid.uuid4().hex}"
    consumer = sharded(redis, stream)
    await consumer.ensure_group()
    await add(redis, stream, 0, "a")
    await redis.delete(SHARDS.name(stream, 1))
    assert [e.record_id for e in await consumer.read(10, block_ms=10)] == ["a"]
    with pytest.raises(ResponseError, match="NOGROUP"):
        await consumer.read(10, block_ms=10)


async def test_refreshing_held_entries_resets_their_idle_time_on_their_shards(redis: Redis):
    """What the judge does for turns it judges longer than claim_idle_ms: each entry refreshed
    on its own shard, as no delivery."""
    stream = f"t:{uuid.uuid4().hex}"
    consumer = sharded(redis, stream, claim_idle_ms=300)
    await consumer.ensure_group()
    for shard in range(3):
        await add(redis, stream, shard, f"x{shard}", entry_id="1-1")
    held = await consumer.read(10, block_ms=10)
    await asyncio.sleep(0.4)
    await consumer.refresh(*(e.entry_id for e in held))
    for name in SHARDS.names(stream):
        [row] = await redis.xpending_range(name, "g", min="-", max="+", count=10)
        assert (row["consumer"], row["times_delivered"]) == (b"c1", 1)
        assert row["time_since_delivered"] < 400  # idle since the refresh, not the read
