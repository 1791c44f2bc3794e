"""Session state in Redis, shared by every replica.

Keys (prefix `clawrl:gw` by default):
- `{p}:s:{session_id}` hash, TTL refreshed on each request: `next` (index of the session's next
  main turn), and while a turn awaits its next state: `turn` (the serialised `Turn`, without
  turn id/index or finalisation fields), `tid` (its turn id), `hist` (hash of the history it
  ends, assistant reply included).
- `{p}:active` sorted set: session id -> time of last request; every replica sweeps it for
  sessions idle past the timeout.
- `{p}:c:{history_hash}` -> session id: the conversation that ended with that assistant reply,
  so a client that sends no session id is recognised on its next request.

Exactly once: a pending turn only leaves Redis inside a Lua script that reads it, deletes it and
XADDs the finished record in one atomic step (Redis runs one script at a time), so of two
replicas racing for the same turn (next request vs idle sweep vs session done) exactly one sees
it and publishes it; the others find nothing. Finalisation fields are appended to the stored
protobuf bytes: protobuf parsing merges concatenated messages (last value wins for singular
fields), so the script needs no protobuf library.

Redis Cluster is not supported (the scripts touch keys in different hash slots).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from clawrl.common.records import Turn

TURN_TYPE = Turn.DESCRIPTOR.full_name

# Encode turn_id (field 1, string) and turn_index (field 3, varint) in Lua: the index is only
# known inside the script, which keeps indices dense even when a generation fails.
_LUA_HEAD = (
    """
local function varint(n)
  local s = ''
  while n >= 128 do
    s = s .. string.char(n % 128 + 128)
    n = math.floor(n / 128)
  end
  return s .. string.char(n)
end
local function publish(stream, maxlen, tid, data)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
             'id', tid, 'type', '"""
    + TURN_TYPE
    + """', 'data', data)
end
"""
)

# KEYS: session, active, stream. ARGV: session_id, now, ttl, maxlen, extends (space-separated
# history hashes of the request that end at an assistant message), next-state extra,
# mismatch extra. Finalises the pending turn with the request's last message as next state.
ADVANCE = (
    _LUA_HEAD
    + """
local result = {'', 0}
local turn = redis.call('HGET', KEYS[1], 'turn')
if turn then
  local hist = redis.call('HGET', KEYS[1], 'hist')
  local extra = ARGV[6] .. ARGV[7]
  result[2] = 1
  for h in string.gmatch(ARGV[5], '%S+') do
    if h == hist then extra = ARGV[6]; result[2] = 0; break end
  end
  local tid = redis.call('HGET', KEYS[1], 'tid')
  publish(KEYS[3], ARGV[4], tid, turn .. extra)
  redis.call('HDEL', KEYS[1], 'turn', 'tid', 'hist')
  result[1] = tid
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return result
"""
)

# KEYS: session, active, stream, conversation. ARGV: session_id, now, ttl, maxlen, turn bytes,
# history hash (with the reply), superseded extra, done extra ('' = keep pending).
# Stores the new pending turn; a turn still pending (concurrent requests in one session) is
# finalised as superseded first, never overwritten.
STORE = (
    _LUA_HEAD
    + """
local result = {'', ''}
local old = redis.call('HGET', KEYS[1], 'turn')
if old then
  local oldtid = redis.call('HGET', KEYS[1], 'tid')
  publish(KEYS[3], ARGV[4], oldtid, old .. ARGV[7])
  result[2] = oldtid
end
local index = redis.call('HINCRBY', KEYS[1], 'next', 1) - 1
local tid = ARGV[1] .. ':' .. index
local turn = '\\10' .. varint(#tid) .. tid .. '\\24' .. varint(index) .. ARGV[5]
result[1] = tid
if ARGV[8] ~= '' then
  publish(KEYS[3], ARGV[4], tid, turn .. ARGV[8])
  redis.call('HDEL', KEYS[1], 'turn', 'tid', 'hist')
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  redis.call('HSET', KEYS[1], 'turn', turn, 'tid', tid, 'hist', ARGV[6])
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[4], ARGV[1], 'EX', ARGV[3])
return result
"""
)

# KEYS: session, active, stream. ARGV: session_id, maxlen, extra, cutoff ('' = none).
# Finalises the pending turn with no next state (session done, or idle when the session's last
# activity is still at or before the cutoff: a request that touched it since wins).
FINALIZE = (
    _LUA_HEAD
    + """
if ARGV[4] ~= '' then
  local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if not score or tonumber(score) > tonumber(ARGV[4]) then return false end
end
redis.call('ZREM', KEYS[2], ARGV[1])
local turn = redis.call('HGET', KEYS[1], 'turn')
if not turn then return '' end
local tid = redis.call('HGET', KEYS[1], 'tid')
publish(KEYS[3], ARGV[2], tid, turn .. ARGV[3])
redis.call('HDEL', KEYS[1], 'turn', 'tid', 'hist')
return tid
"""
)


# --- canonical history hashing (pure) -----------------------------------------------------


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments JSON-normalised (parsed), or the raw text when it is not JSON."""
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def canonical_message(message: dict[str, Any]) -> bytes:
    """A message as compared across turns: role, content text (outer whitespace stripped),
    tool-call names and parsed arguments; tool-call ids and other fields are ignored.
    `message` has text content (a ChatRequest.render_messages entry or a response message)."""
    calls = [
        [call["function"]["name"], _arguments(call["function"].get("arguments", "{}"))]
        for call in message.get("tool_calls") or ()
    ]
    content = message.get("content") or ""
    return orjson.dumps([message["role"], content.strip(), calls], option=orjson.OPT_SORT_KEYS)


def extend_hash(previous: str, message: dict[str, Any]) -> str:
    """Chain hash of a history extended by one message."""
    digest = hashlib.blake2b(previous.encode(), digest_size=16)
    digest.update(canonical_message(message))
    return digest.hexdigest()


def history_hashes(messages: Sequence[dict[str, Any]]) -> list[str]:
    """hashes[i] identifies messages[: i + 1]: equal histories, compared canonically, give
    equal hashes."""
    hashes, current = [], ""
    for message in messages:
        current = extend_hash(current, message)
        hashes.append(current)
    return hashes


def assistant_prefixes(messages: Sequence[dict[str, Any]], hashes: Sequence[str]) -> list[str]:
    """Hashes of the histories inside this request that end at an assistant reply and are
    followed by at least one more message, longest first: the candidates for "this request
    continues a recorded turn"."""
    return [
        hashes[i] for i in range(len(messages) - 2, -1, -1) if messages[i]["role"] == "assistant"
    ]


# --- the store (I/O) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Advanced:
    finalized_turn_id: str | None
    history_mismatch: bool


@dataclass(frozen=True)
class Stored:
    turn_id: str
    superseded_turn_id: str | None


class SessionStore:
    """The scripts above over one Redis connection pool."""

    def __init__(self, redis: Redis, *, prefix: str, stream: str, maxlen: int, ttl_s: int) -> None:
        self.redis = redis
        self.prefix = prefix
        self.stream = stream
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.active_key = f"{prefix}:active"
        self._advance = redis.register_script(ADVANCE)
        self._store = redis.register_script(STORE)
        self._finalize = redis.register_script(FINALIZE)

    def session_key(self, session_id: str) -> str:
        return f"{self.prefix}:s:{session_id}"

    def conversation_key(self, history_hash: str) -> str:
        return f"{self.prefix}:c:{history_hash}"

    async def find_session(self, prefixes: Sequence[str]) -> str | None:
        """The session whose recorded reply ends the longest of these histories."""
        if not prefixes:
            return None
        found = await self.redis.mget([self.conversation_key(h) for h in prefixes])
        for session_id in found:
            if session_id is not None:
                return session_id.decode() if isinstance(session_id, bytes) else session_id
        return None

    async def advance(
        self, session_id: str, prefixes: Sequence[str], next_state: bytes, mismatch: bytes
    ) -> Advanced:
        tid, mismatched = await self._advance(
            keys=[self.session_key(session_id), self.active_key, self.stream],
            args=[
                session_id,
                time.time(),
                self.ttl_s,
                self.maxlen,
                " ".join(prefixes),
                next_state,
                mismatch,
            ],
        )
        return Advanced(_text(tid) or None, bool(mismatched))

    async def store(
        self, session_id: str, turn: bytes, history_hash: str, superseded: bytes, done: bytes
    ) -> Stored:
        tid, old = await self._store(
            keys=[
                self.session_key(session_id),
                self.active_key,
                self.stream,
                self.conversation_key(history_hash),
            ],
            args=[
                session_id,
                time.time(),
                self.ttl_s,
                self.maxlen,
                turn,
                history_hash,
                superseded,
                done,
            ],
        )
        return Stored(_text(tid), _text(old) or None)

    async def finalize(
        self, session_id: str, extra: bytes, idle_cutoff: float | None = None
    ) -> str | None:
        """Publish the session's pending turn with `extra` appended; its turn id, or None when
        there was none (or, with a cutoff, the session was touched after it)."""
        tid = await self._finalize(
            keys=[self.session_key(session_id), self.active_key, self.stream],
            args=[session_id, self.maxlen, extra, "" if idle_cutoff is None else idle_cutoff],
        )
        return _text(tid) or None

    async def idle_sessions(self, cutoff: float, limit: int) -> list[str]:
        found = await self.redis.zrangebyscore(self.active_key, "-inf", cutoff, 0, limit)
        return [_text(s) for s in found]

    async def active_count(self) -> int:
        return int(await self.redis.zcard(self.active_key))


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)
