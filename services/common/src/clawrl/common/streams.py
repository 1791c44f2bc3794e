"""Redis Streams: appending records, and consuming them in a consumer group.

Entries carry `{id, type, data}` (see records.py). Delivery to a consumer group is
at-least-once: a consumer XACKs an entry only once its work is durable, so a consumer that dies
leaves its entries pending, and a live one takes them over (XCLAIM) once they are idle for
`claim_idle_ms`. Consumers therefore deduplicate on the record `id`. A consumer never takes over
what it still holds itself (read and neither acknowledged nor released), however long it holds
it. Entries pending on a consumer that it neither holds nor released after a failure (a read
whose reply a dropped connection lost, entries it forgot unstarted, an acknowledgement a
failover lost) are its strays, taken back within seconds rather than after `claim_idle_ms`.
An entry delivered more than `max_deliveries` times without being acknowledged (a poison
entry) goes to the dead-letter stream with its reason.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from clawrl.common.records import Sample, Turn, encode_entry
from clawrl.common.redis_client import REDIS_ERRORS
from clawrl.common.shards import Shards

log = logging.getLogger(__name__)

STRAY_IDLE_MS = 1_000  # GroupConsumer.take_strays
STRAY_PAGE = 500


async def publish(redis: Redis, stream: str, record: Turn | Sample, maxlen: int) -> str:
    """XADD one record (trimming the stream to about `maxlen`); returns the entry id."""
    entry_id = await redis.xadd(stream, encode_entry(record), maxlen=maxlen, approximate=True)
    return _text(entry_id)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class Entry:
    """One delivered stream entry: its stream id, its fields, and how often it was delivered."""

    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int = 1

    @property
    def record_id(self) -> str:
        """The record's stable id (a turn's or a sample's id), "" when the entry has none."""
        return _text(self.fields.get(b"id", b""))

    @property
    def added_s(self) -> float:
        """When the entry was added (its stream id's milliseconds; a ShardedConsumer's ids
        carry the shard in front)."""
        return int(self.entry_id.rpartition("/")[2].partition("-")[0]) / 1000.0


class GroupConsumer:
    """One consumer of a consumer group: reads new entries, claims those a dead consumer left
    pending, acknowledges, and dead-letters poison entries."""

    def __init__(
        self,
        redis: Redis,
        *,
        stream: str,
        group: str,
        consumer: str,
        deadletter_stream: str,
        max_deliveries: int = 5,
        claim_idle_ms: int = 60_000,
        deadletter_maxlen: int = 100_000,
        sweep_interval_s: float = 5.0,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.deadletter_stream = deadletter_stream
        self.max_deliveries = max_deliveries
        self.claim_idle_ms = claim_idle_ms
        self.deadletter_maxlen = deadletter_maxlen
        # Entries handed out and not yet acknowledged, dead-lettered or released: never claimed
        # back from ourselves (each claim would count as one more delivery).
        self.holding: set[str] = set()
        # Released ones (some still pending, to be claimed once idle): not strays (see below).
        self.released: set[str] = set()
        self.sweep_interval_s = sweep_interval_s
        self._next_sweep = 0.0  # the first read sweeps: a restart under the same name

    async def ensure_group(self) -> None:
        """Create the group (reading from the stream's start) unless it exists."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int, block_ms: int | None = 1000) -> list[Entry]:
        """Up to `count` entries: first this consumer's strays (every `sweep_interval_s`), then
        those idle past `claim_idle_ms` that it does not hold (a dead consumer's, or released
        ones), then new ones (blocking up to `block_ms` when there are none; None: not at all).
        The caller holds them until it acks, dead-letters or releases."""
        entries: list[Entry] = []
        try:
            if time.monotonic() >= self._next_sweep:
                entries = await self.take_strays(count)
                self._next_sweep = time.monotonic() + self.sweep_interval_s
            entries += await self.claim(count - len(entries))
            if len(entries) < count:
                reply = await self.redis.xreadgroup(
                    self.group,
                    self.consumer,
                    {self.stream: ">"},
                    count=count - len(entries),
                    block=None if entries else block_ms,
                )
                for _stream, items in reply or []:
                    entries += [Entry(_text(eid), fields) for eid, fields in items if fields]
        except REDIS_ERRORS:
            # What this read took before it failed was never handed out: strays for a sweep.
            self.holding.difference_update(entry.entry_id for entry in entries)
            raise
        self.holding.update(entry.entry_id for entry in entries)
        return entries

    async def read_own_pending(self, count: int) -> list[Entry]:
        """Up to `count` entries this consumer was given but never acknowledged, oldest first:
        a restart under the same consumer name takes its work back at once, without waiting
        `claim_idle_ms`. Entries trimmed from the stream meanwhile are acknowledged. Their
        delivery counts are not read: each restart adds one whatever the entry did, so they
        cannot tell a poison entry; the trainer counts the steps that died with an entry instead
        (trainer/intake.py)."""
        entries: list[Entry] = []
        cursor = "0-0"
        while len(entries) < count:
            reply = await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: cursor}, count=count - len(entries)
            )
            items = [item for _stream, batch in reply or [] for item in batch]
            if not items:
                break
            cursor = _text(items[-1][0])
            entries += [Entry(_text(eid), fields) for eid, fields in items if fields]
            await self.ack(*[_text(eid) for eid, fields in items if not fields])
        self.holding.update(entry.entry_id for entry in entries)
        return entries

    async def claim(self, count: int) -> list[Entry]:
        """Take over up to `count` entries pending for longer than `claim_idle_ms` that this
        consumer does not hold. XCLAIM re-checks the idle time, so of two consumers racing for
        an entry only one gets it. Entries then delivered more than `max_deliveries` times are
        dead-lettered here, not returned. (Entries trimmed from the stream while pending leave
        the pending list in the XCLAIM: Redis >= 7.)"""
        deliveries = await self._idle_pending(count) if count > 0 else {}
        return await self._take(deliveries, self.claim_idle_ms)

    async def take_strays(self, count: int) -> list[Entry]:
        """Up to `count` entries pending on this consumer, idle for `STRAY_IDLE_MS`, that it
        neither holds nor released: Redis delivered them to a read (or claim) whose reply never
        came back (a dropped connection, a failover; redis-py's retry then reads on), or to an
        earlier process under the same name. Taken back now rather than after `claim_idle_ms`
        (a minute by default), as one more delivery. The idle floor keeps a racing consumer's
        fresh claim from being taken back: XCLAIM re-checks it."""
        own: dict[str, tuple[int, int]] = {}  # entry id -> (idle ms, deliveries)
        start = "-"
        while True:
            rows = await self.redis.xpending_range(
                self.stream, self.group, min=start, max="+", count=STRAY_PAGE,
                consumername=self.consumer,
            )  # fmt: skip
            for row in rows:
                own[_text(row["message_id"])] = (
                    int(row["time_since_delivered"]), int(row["times_delivered"])
                )  # fmt: skip
            if len(rows) < STRAY_PAGE:
                break
            start = "(" + _text(rows[-1]["message_id"])
        self.released &= own.keys()  # the rest were acknowledged or taken over since
        strays = dict(itertools.islice(
            ((eid, deliveries) for eid, (idle_ms, deliveries) in own.items()
             if idle_ms >= STRAY_IDLE_MS and eid not in self.holding and eid not in self.released),
            max(count, 0),
        ))  # fmt: skip
        if strays:
            log.warning("taking back %d entries of %s delivered to %s and never received",
                        len(strays), self.stream, self.consumer)  # fmt: skip
        return await self._take(strays, STRAY_IDLE_MS)

    async def _take(self, deliveries: dict[str, int], min_idle_ms: int) -> list[Entry]:
        """XCLAIM these entries (id -> deliveries so far) if still idle for `min_idle_ms`; those
        now delivered more than `max_deliveries` times are dead-lettered, not returned."""
        if not deliveries:
            return []
        reply = await self.redis.xclaim(
            self.stream,
            self.group,
            self.consumer,
            min_idle_time=min_idle_ms,
            message_ids=list(deliveries),
        )
        entries = []
        for eid, fields in reply:
            if not fields:
                continue
            # XCLAIM counted one more delivery than the XPENDING row said.
            entry = Entry(_text(eid), fields, deliveries[_text(eid)] + 1)
            self.holding.add(entry.entry_id)
            self.released.discard(entry.entry_id)
            if entry.deliveries > self.max_deliveries:
                await self.dead_letter(
                    entry, f"delivered {entry.deliveries} times without being acknowledged"
                )
            else:
                entries.append(entry)
        return entries

    async def _idle_pending(self, count: int) -> dict[str, int]:
        """Up to `count` entries pending for at least `claim_idle_ms` and not held here, oldest
        first, each with its delivery count (XPENDING's extended form, paged past held ones)."""
        found: dict[str, int] = {}
        start = "-"
        while len(found) < count:
            rows = await self.redis.xpending_range(
                self.stream, self.group, min=start, max="+", count=count, idle=self.claim_idle_ms
            )
            for row in rows:
                eid = _text(row["message_id"])
                if eid not in self.holding and len(found) < count:
                    found[eid] = int(row["times_delivered"])
            if len(rows) < count:
                break
            start = "(" + _text(rows[-1]["message_id"])  # exclusive: the next page
        return found

    async def refresh(self, *entry_ids: str) -> None:
        """Reset held entries' idle time (XCLAIM JUSTID to this consumer: no delivery counted),
        so that work taking longer than `claim_idle_ms` is not taken over as abandoned."""
        if entry_ids:
            await self.redis.xclaim(self.stream, self.group, self.consumer, min_idle_time=0,
                                    message_ids=list(entry_ids), justid=True)  # fmt: skip

    def release(self, *entry_ids: str) -> None:
        """Stop holding entries whose work failed, without acknowledging them: they are taken
        over once idle for `claim_idle_ms` (the retry's back-off), by this consumer too, each
        time as one more delivery."""
        self.holding.difference_update(entry_ids)
        self.released.update(entry_ids)

    def forget(self, *entry_ids: str) -> None:
        """Stop holding entries without releasing them: acknowledged elsewhere (inside a
        script, with their work), or never worked on (the caller failed right after the read).
        One still pending here (never started, or its XACK lost in a failover: the old primary
        answered, its replica never had it) is a stray, taken back at the next sweep."""
        self.holding.difference_update(entry_ids)

    async def ack(self, *entry_ids: str) -> None:
        if entry_ids:
            await self.redis.xack(self.stream, self.group, *entry_ids)
            self.holding.difference_update(entry_ids)

    async def dead_letter(self, entry: Entry, reason: str) -> None:
        """Move an entry to the dead-letter stream with its reason, then acknowledge it, in one
        MULTI so it is never both lost and still pending."""
        fields = {
            **entry.fields,
            b"reason": reason.encode(),
            b"source_stream": self.stream.encode(),
            b"source_group": self.group.encode(),
            b"source_entry": entry.entry_id.encode(),
            b"dead_at": str(time.time()).encode(),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(
                self.deadletter_stream, fields, maxlen=self.deadletter_maxlen, approximate=True
            )
            pipe.xack(self.stream, self.group, entry.entry_id)
            await pipe.execute()
        self.holding.discard(entry.entry_id)
        log.warning(
            "dead-lettered %s entry %s (%s): %s",
            self.stream,
            entry.entry_id,
            entry.record_id or "no id",
            reason,
        )

    async def lag(self) -> int:
        """Entries of the stream not yet delivered to this group (Redis >= 7: the group's lag)."""
        for group in await self.redis.xinfo_groups(self.stream):
            if _text(group["name"]) == self.group:
                lag = group.get("lag")
                return int(lag) if lag is not None else 0
        return 0


class ShardedConsumer:
    """One consumer of a group over every shard of a stream (common/shards.py), with
    GroupConsumer's interface: one GroupConsumer per shard underneath. The entry ids it hands
    out are `{shard}/{stream id}` (two shards' streams may both hold `1700000000000-0`), and
    `ack`, `release` and `dead_letter` take them back to their shard. A read takes what the
    shards have at once, starting one shard further each time so that none starves, and only
    when none has anything blocks on one shard after the other (`block_ms` split between them).
    """

    def __init__(self, shards: list[GroupConsumer], *, stream: str) -> None:
        if not shards:
            raise ValueError("a ShardedConsumer needs at least one shard")
        self.shards = shards
        self.redis = shards[0].redis
        self.stream = stream  # the unsharded name, for keys of the consumer's own
        self.group = shards[0].group
        self.consumer = shards[0].consumer
        self.max_deliveries = shards[0].max_deliveries
        self._next = 0

    def _split(self, entry_id: str) -> tuple[GroupConsumer, str]:
        shard, _, raw = entry_id.partition("/")
        return self.shards[int(shard)], raw

    @staticmethod
    def _qualified(shard: int, entries: list[Entry]) -> list[Entry]:
        return [Entry(f"{shard}/{e.entry_id}", e.fields, e.deliveries) for e in entries]

    async def ensure_group(self) -> None:
        for shard in self.shards:
            await shard.ensure_group()

    async def read(self, count: int, block_ms: int | None = 1000) -> list[Entry]:
        entries: list[Entry] = []
        order = [(self._next + i) % len(self.shards) for i in range(len(self.shards))]
        self._next = (self._next + 1) % len(self.shards)
        for index in order:
            if len(entries) < count:
                try:
                    got = await self.shards[index].read(count - len(entries), block_ms=None)
                except REDIS_ERRORS as exc:
                    if not entries:
                        raise
                    # Earlier shards' entries are held now: hand them out; this shard's error
                    # comes back at the next read.
                    log.warning("reading %s failed after other shards delivered: %s",
                                self.shards[index].stream, exc)  # fmt: skip
                    return entries
                entries += self._qualified(index, got)
        if entries or not block_ms:
            return entries
        wait = max(1, block_ms // len(self.shards))
        for index in order:
            got = await self.shards[index].read(count, block_ms=wait)
            if got:
                return self._qualified(index, got)
        return []

    async def read_own_pending(self, count: int) -> list[Entry]:
        entries: list[Entry] = []
        for index, shard in enumerate(self.shards):
            if len(entries) < count:
                own = await shard.read_own_pending(count - len(entries))
                entries += self._qualified(index, own)
        return entries

    def release(self, *entry_ids: str) -> None:
        for entry_id in entry_ids:
            shard, raw = self._split(entry_id)
            shard.release(raw)

    def forget(self, *entry_ids: str) -> None:
        for entry_id in entry_ids:
            shard, raw = self._split(entry_id)
            shard.forget(raw)

    def _by_shard(self, entry_ids: tuple[str, ...]) -> dict[int, list[str]]:
        by_shard: dict[int, list[str]] = {}
        for entry_id in entry_ids:
            shard, _, raw = entry_id.partition("/")
            by_shard.setdefault(int(shard), []).append(raw)
        return by_shard

    async def ack(self, *entry_ids: str) -> None:
        for index, raws in self._by_shard(entry_ids).items():
            await self.shards[index].ack(*raws)

    async def refresh(self, *entry_ids: str) -> None:
        for index, raws in self._by_shard(entry_ids).items():
            await self.shards[index].refresh(*raws)

    async def dead_letter(self, entry: Entry, reason: str) -> None:
        shard, raw = self._split(entry.entry_id)
        await shard.dead_letter(Entry(raw, entry.fields, entry.deliveries), reason)

    async def lag(self) -> int:
        return sum([await shard.lag() for shard in self.shards])


def consumer_over(
    redis: Redis, shards: Shards, *, stream: str, deadletter_stream: str, **options: Any
) -> GroupConsumer | ShardedConsumer:
    """A consumer of `stream` (its configured name) as `shards` lay it out: a GroupConsumer on
    an unsharded store, else a ShardedConsumer (each shard dead-letters into its own shard of
    `deadletter_stream`, in the same MULTI as its XACK). `options`: GroupConsumer's."""
    if not shards.tagged:
        return GroupConsumer(redis, stream=stream, deadletter_stream=deadletter_stream, **options)
    consumers = [
        GroupConsumer(redis, stream=name, deadletter_stream=dead, **options)
        for name, dead in zip(shards.names(stream), shards.names(deadletter_stream), strict=True)
    ]
    return ShardedConsumer(consumers, stream=stream)


async def trim_acknowledged(
    redis: Redis, stream: str, keep_min_id: str | None = None, *, approximate: bool = True
) -> int:
    """Trim `stream` (XTRIM MINID) below the oldest entry any consumer group still needs: the
    oldest pending entry of every group, or the entry after its last delivered one. With
    `keep_min_id` (a retention floor such as `{ms}-0`) never trim at or above that id either.
    Approximate trimming (the default, cheap) removes only whole radix-tree nodes, so it may keep
    more. Returns the number of entries removed."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:
        return 0  # no such stream
    floor: tuple[int, int] | None = None
    for group in groups:
        name = _text(group["name"])
        summary = await redis.xpending(stream, name)
        if summary["pending"]:
            candidate = _parse_id(_text(summary["min"]))
        else:
            last = _parse_id(_text(group["last-delivered-id"]))
            candidate = (last[0], last[1] + 1)
        floor = candidate if floor is None else min(floor, candidate)
    if floor is None:
        return 0  # nobody consumes it yet: keep everything
    if keep_min_id is not None:
        floor = min(floor, _parse_id(keep_min_id))
    minid = f"{floor[0]}-{floor[1]}"
    return int(await redis.xtrim(stream, minid=minid, approximate=approximate))


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
