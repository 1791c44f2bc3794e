"""The wire records on the Redis Streams (`Turn`, `Sample`, protobuf clawrl.v1) and how one is
laid out in a stream entry: `{id, type, data}` with `data` the serialised message, so a consumer
can deduplicate on `id` without parsing and reject an unknown `type` into the dead-letter stream."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from clawrl.common.proto.records_pb2 import Sample, Turn
from clawrl.common.redis_text import text

__all__ = ["RecordError", "Sample", "Turn", "decode_entry", "encode_entry", "turn_id"]

M = TypeVar("M", bound=Message)


class RecordError(ValueError):
    """A stream entry that is not a well-formed record of the expected type."""


def turn_id(session_id: str, epoch: str, turn_index: int) -> str:
    """The stable id of a turn (and of the sample made from it). `epoch` names the gateway's
    state of the session the turn was recorded in, so the ids of a session id that comes back
    after its state expired never repeat those of its earlier turns."""
    return f"{session_id}:{epoch}:{turn_index}"


def session_of(turn_id: str) -> str:
    """The client's session id of a turn id (a session id may hold ':')."""
    return turn_id.rsplit(":", 2)[0]


def session_state_of(turn_id: str) -> str:
    """The session state a turn (or its sample) belongs to, `{session_id}:{epoch}`: what
    per-session bookkeeping keys on. Not the client's session id, which callers may share
    (sessions are scoped per caller: two API keys that both send `X-Session-Id: main` hold two
    states, with two epochs)."""
    return turn_id.rsplit(":", 1)[0]


def record_id(record: Message) -> str:
    if isinstance(record, Turn):
        return record.turn_id
    if isinstance(record, Sample):
        return record.sample_id
    raise TypeError(f"not a stream record: {type(record).__name__}")


def encode_entry(record: Turn | Sample) -> dict[str, bytes]:
    """Stream entry fields for one record."""
    return {
        "id": record_id(record).encode(),
        "type": record.DESCRIPTOR.full_name.encode(),
        "data": record.SerializeToString(),
    }


def decode_entry(fields: dict[bytes | str, bytes], record_type: type[M]) -> M:
    """The record in a stream entry, checked to be of `record_type`."""
    normalized = {text(k): v for k, v in fields.items()}
    kind = text(normalized.get("type", b""))
    if kind != record_type.DESCRIPTOR.full_name:
        raise RecordError(f"expected a {record_type.DESCRIPTOR.full_name} entry, got {kind!r}")
    record = record_type()
    try:
        record.ParseFromString(normalized.get("data", b""))
    except DecodeError as exc:
        raise RecordError(f"undecodable {kind} entry: {exc}") from exc
    return record
