"""Redis Streams: appending records. Entries carry `{id, type, data}` (see records.py);
delivery to consumer groups is at-least-once, so consumers deduplicate on `id`."""

from __future__ import annotations

from redis.asyncio import Redis

from clawrl.common.records import Sample, Turn, encode_entry


async def publish(redis: Redis, stream: str, record: Turn | Sample, maxlen: int) -> str:
    """XADD one record (trimming the stream to about `maxlen`); returns the entry id."""
    entry_id = await redis.xadd(stream, encode_entry(record), maxlen=maxlen, approximate=True)
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
