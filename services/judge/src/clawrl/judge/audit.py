"""The audit trail: one JSON record per judgement on the audit stream (written by store.py's
commit script, or for a dead-lettered turn by the worker), and `clawrl-judge export`, which
writes them as JSONL so a user can see why a turn got its reward."""

from __future__ import annotations

from typing import IO, Any

import orjson
from redis.asyncio import Redis

from clawrl.common.redis_text import text

PAGE = 1000


def audit_record(entry_id: str, fields: dict[bytes, bytes]) -> dict[str, Any]:
    """One exported line: the judgement as judged, with what the commit decided (published,
    promoted: trained by the at-least-one-sample-per-session rule, dead_letter)."""
    record = orjson.loads(fields.get(b"data", b"{}"))
    outcome = fields.get(b"outcome", b"").decode()
    record["outcome"] = outcome
    record["audit_entry"] = entry_id
    if b"sample_entry" in fields:
        record["sample_entry"] = fields[b"sample_entry"].decode()
    if outcome == "promoted":
        record["promoted"] = True
        record["mask_reason"] = "MASK_REASON_UNSPECIFIED"
    return record


async def export(redis: Redis, stream: str, out: IO[bytes], start: str = "-") -> int:
    """Write every audit record from `start` on as JSONL to `out`; returns how many."""
    written = 0
    cursor = start
    while True:
        entries = await redis.xrange(stream, min=cursor, max="+", count=PAGE)
        if not entries:
            return written
        for entry_id, fields in entries:
            entry = text(entry_id)
            out.write(orjson.dumps(audit_record(entry, fields)) + b"\n")
            written += 1
        cursor = f"({entry}"  # exclusive: the next page starts after the last one written
