"""Session state in Redis, shared by every replica. The scripts live in `lua/*.lua`.

Keys (prefix `{p}` = `clawrl:gw` by default; sharded, each shard's prefix: `clawrl:gw:{s0}`,
see common/shards.py; a session's keys are in the shard of its id, its turns go to that shard's
turn stream):
- `{p}:s:{scope}:{session_id}` hash, one per caller (`scope`: caller_scope, a hash of its API key
  and `user`) and session id: two callers who send the same `X-Session-Id` have two sessions,
  and neither can finalise, close or rate the other's turns. The session id itself stays the
  client's (Turn.session_id, turn ids, X-Session-Id): a turn id is unique all the same, its epoch
  being drawn per session state. TTL refreshed on each request: `next` (index of the session's
  next main turn), `epoch` (made with the state, from its first request's id: turn ids are
  `{session_id}:{epoch}:{index}`, so a session id whose state expired and that comes back gets
  new ids, never those of turns already judged or trained), `episode` (1 once a turn of it was
  recorded with X-Episode: POST /v1/outcomes takes an outcome for it), and while a turn awaits
  its next state: `turn` (the serialised `Turn`, without
  turn id/index or finalisation fields), `tid` (its turn id), `hist` (hash of the history it
  ends, assistant reply included), `req` (hash of its request's history: a request with the same
  history is the client retrying it), `at` (when it was stored).
- `{p}:active` sorted set: session member (`{scope}:{session_id}`, session_member) -> time of
  last request; every replica sweeps it for sessions idle past the timeout.
- `{p}:pending-hist` hash: session member -> `hist` of its pending turn (the claim check of
  another session reads it here: a script touches only keys it is given).
- `{p}:c:{scope}:{history_hash}` -> session id: the conversation of one caller (`scope`, a hash
  of its API key and `user`) that ended with that assistant reply, so a client that sends no
  session id is recognised on its next request (looked up in every shard before the record
  script, `SessionStore.resolve`: two shards naming different sessions is ambiguous too);
  `*` when two live sessions of the caller ended the same history (identical openings under
  greedy decoding): then nobody is guessed.
- `{p}:r:{request_id}:{step}` -> a script's result, kept a few minutes: a retried script is a
  no-op that returns it.
- `{p}:fb:{request_id}` -> `{turn_id}\n{scope}` of a recorded main turn, kept the feedback TTL:
  POST /v1/feedback finds a turn by the response id its client got back, and only that caller
  may rate it (by session id, the caller's own session state names its turns).

A gateway from before sessions were per caller kept `{p}:s:{session_id}` with the bare session id
as its member: such a member names that key (session_key_of_member), so the idle sweep still
finalises the turns it left pending.

Exactly once: a pending turn only leaves Redis inside a Lua script that reads it, deletes it and
XADDs the finished record in one atomic step (Redis runs one script at a time), so of two
replicas racing for the same turn (next request vs idle sweep vs session done) exactly one sees
it and publishes it; the others find nothing; and a script the client retries after a timeout
replays its first result instead of running twice. Finalisation fields are appended to the
stored protobuf bytes: protobuf parsing merges concatenated messages (last value wins for
singular fields, repeated ones concatenate), so the scripts need no protobuf library.

Redis Cluster: every key a script touches is passed in KEYS and is in the session's shard (one
hash slot), so the scripts run unchanged on a cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import orjson
from redis.asyncio import Redis

from clawrl.common.records import Turn
from clawrl.common.redis_client import Script
from clawrl.common.shards import Shards

TURN_TYPE = Turn.DESCRIPTOR.full_name
SCRIPTS = ("record", "finalize")
# A session member: the caller's scope (caller_scope: "-" or 24 hex digits), then the session id.
MEMBER = re.compile(r"(-|[0-9a-f]{24}):(.*)", re.DOTALL)


def load_script(name: str) -> str:
    """A session script with the shared helpers in front; `.lua` files are package data, read
    with importlib.resources so editable and wheel installs both find them."""
    lua = resources.files("clawrl.gateway").joinpath("lua")
    header = f"local TURN_TYPE = '{TURN_TYPE}'\n" + lua.joinpath("common.lua").read_text()
    return header + "\n" + lua.joinpath(f"{name}.lua").read_text()


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


def history_hashes(messages: Sequence[dict[str, Any]], api: str = "chat") -> list[str]:
    """hashes[i] identifies messages[: i + 1]: equal histories, compared canonically, give
    equal hashes. The chain starts from the API the request came through (chat's from ""):
    a request of one API never continues a conversation of another, so a session that mixes
    them is noticed (its turn is finalised with history_mismatch) and an anonymous one is not
    matched across them."""
    hashes, current = [], "" if api == "chat" else api
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


def session_epoch(request_id: str) -> str:
    """The epoch of a session state that request `request_id` creates. From the request id
    (unique per request) rather than drawn at random, so a write of that request retried or
    replayed later names the same turns. 48 bits: two states of one session id share an epoch
    with odds of 2**-48 (a client would need millions of expired states to make it likely)."""
    return hashlib.blake2b(request_id.encode(), digest_size=6).hexdigest()


# --- the store (I/O) ----------------------------------------------------------------------


def caller_scope(credential: str | None, user: str | None) -> str:
    """The namespace of a caller's anonymous conversations: a hash of its API key (or, with keys
    off, whatever bearer token it sends) and of the OpenAI `user` field. Never the key itself."""
    if not credential and not user:
        return "-"
    digest = hashlib.blake2b(digest_size=12)
    digest.update((credential or "").encode())
    digest.update(b"\0" + (user or "").encode())
    return digest.hexdigest()


def session_member(scope: str, session_id: str) -> str:
    """The name of one caller's session in Redis (active set, pending-history index, state key):
    the session id a client sends names a session of that caller only."""
    return f"{scope}:{session_id}"


def member_session_id(member: str) -> str:
    """The client's session id of a session member (a member written before sessions were per
    caller is the bare session id)."""
    scoped = MEMBER.fullmatch(member)
    return scoped.group(2) if scoped else member


@dataclass(frozen=True)
class Recorded:
    """What the record script did for one main request."""

    session_id: str
    finalized_turn_id: str | None  # the turn this request is the next state of
    history_mismatch: bool  # ... whose history this request does not extend
    ambiguous: bool  # an anonymous history claimed by two live sessions: a new one was started
    turn_id: str | None  # this request's turn (None when it failed and stored nothing)
    superseded_turn_id: str | None  # a concurrent request's turn, stored after this one arrived
    claim_ambiguous: bool  # another live session of the caller ends the same history
    orphaned_turn_id: str | None = None  # the pending turn this request retried (same history)


class SessionStore:
    """The session scripts over one Redis connection pool. Every call carries the id of the
    request it serves; a script run again with the same id (a retry after a timeout whose
    first run went through) returns the first result and writes nothing."""

    def __init__(
        self,
        redis: Redis,
        *,
        prefix: str,
        stream: str,
        maxlen: int,
        ttl_s: int,
        dedupe_ttl_s: int = 120,
        feedback_ttl_s: int = 0,
        shards: Shards | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.redis = redis
        # A bound on each Redis call, for a client made without a socket timeout (whose
        # scripts go by direct_command, the fast way); None: the client's own timeouts.
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.stream = stream
        shards = shards or Shards()
        self.shards = shards
        self.prefixes = shards.names(prefix)  # each shard's key prefix
        self.streams = shards.names(stream)  # each shard's turn stream
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.dedupe_ttl_s = dedupe_ttl_s
        self.feedback_ttl_s = feedback_ttl_s  # 0: no feedback index
        self.active_keys = [f"{p}:active" for p in self.prefixes]
        self.active_key = self.active_keys[0]
        self._scripts = {
            name: Script(redis, load_script(name), direct=True, timeout_s=timeout_s)
            for name in SCRIPTS
        }

    def _bounded(self) -> asyncio.Timeout:
        return asyncio.timeout(self.timeout_s)

    def session_key(self, session_id: str, scope: str) -> str:
        """The state of caller `scope`'s session `session_id`."""
        return self.member_key(session_member(scope, session_id))

    def member_key(self, member: str) -> str:
        """The state of a session member, in the shard of its session id."""
        return f"{self.prefixes[self.shards.of(member_session_id(member))]}:s:{member}"

    def conversation_key(self, scope: str, history_hash: str, shard: int = 0) -> str:
        return f"{self.prefixes[shard]}:c:{scope}:{history_hash}"

    def feedback_index_key(self, request_id: str, shard: int = 0) -> str:
        return f"{self.prefixes[shard]}:fb:{request_id}"

    def request_key(self, request_id: str, step: str, shard: int) -> str:
        return f"{self.prefixes[shard]}:r:{request_id}:{step}"

    def _keys(self, request_id: str, step: str, member: str) -> list[str]:
        """The keys both scripts touch, all in the session's shard (common.lua)."""
        shard = self.shards.of(member_session_id(member))
        return [
            self.active_keys[shard],
            self.streams[shard],
            self.request_key(request_id, step, shard),
            self.feedback_index_key(request_id, shard),
            self.member_key(member),
            f"{self.prefixes[shard]}:pending-hist",
        ]

    async def resolve(
        self, request_id: str, scope: str, prefixes: Sequence[str]
    ) -> tuple[str | None, bool]:
        """The session of an anonymous request: (session id, ambiguous). The session whose
        reply ends the longest of `prefixes` in the caller's conversations; (None, True) when
        two live sessions claim that history (nobody is guessed: a new session starts), (None,
        False) when none does. A request already recorded (a retried call) gets the session it
        was recorded in. One MGET per shard: a claim lives in its session's shard."""
        replies = []
        for shard in range(self.shards.count):
            keys = [self.request_key(request_id, "record", shard)]
            keys += [self.conversation_key(scope, h, shard) for h in prefixes]
            async with self._bounded():
                replies.append(await self.redis.mget(keys))
        for earlier, *_ in replies:
            if earlier is not None:
                return orjson.loads(earlier)[0], False
        for i in range(len(prefixes)):
            owners = {_text(reply[i + 1]) for reply in replies if reply[i + 1] is not None}
            if "*" in owners or len(owners) > 1:
                return None, True
            if owners:
                return owners.pop(), False
        return None, False

    async def record(
        self,
        request_id: str,
        session_id: str | None,
        *,
        scope: str,
        arrived: float,
        prefixes: Sequence[str],
        next_state: bytes,
        mismatch: bytes,
        superseded: bytes,
        new_session_id: str,
        turn: bytes = b"",
        history_hash: str = "",
        request_hash: str = "",
        done: bytes = b"",
        now: float | None = None,
        orphaned: bytes = b"",
        episode: bool = False,
    ) -> Recorded:
        """One main request: resolve its session (by `prefixes` when it sent none, one round
        trip more: `new_session_id` when no live conversation of the caller matches), finalise the
        turn pending there (with `next_state`, or as superseded when it was stored after
        `arrived`), then store `turn` (none: the request failed) as pending, or publish it with
        `done` appended. A failed request with `done` closes its session. `request_hash`: the
        hash of the request's whole history: a pending turn whose request had the same one is a
        retry's orphan, finalised with `orphaned` (the client never used its reply; b"": with
        `superseded`, as a call spooled by an older gateway has none). `now`: when
        the call was made (a call replayed from the spool keeps its time, so the pending turn it
        stores still precedes the next request's `arrived`). `episode`: the turn is an episode's
        (X-Episode): the session state says so (`episode`), for POST /v1/outcomes."""
        owner, ambiguous = None, False
        if not session_id and prefixes:
            owner, ambiguous = await self.resolve(request_id, scope, prefixes)
        session_id = session_id or owner or new_session_id
        shard = self.shards.of(session_id)
        reply = await self._scripts["record"](
            keys=[
                *self._keys(request_id, "record", session_member(scope, session_id)),
                self.conversation_key(scope, history_hash, shard),
            ],
            args=[
                int(ambiguous),
                session_id,
                scope,
                time.time() if now is None else now,
                self.ttl_s,
                self.maxlen,
                " ".join(prefixes),
                next_state,
                mismatch,
                request_hash,
                self.dedupe_ttl_s,
                arrived,
                superseded,
                turn,
                history_hash,
                done,
                session_epoch(request_id),
                self.feedback_ttl_s,
                orphaned,
                int(episode),
            ],
        )
        sid, tid, mismatched, ambiguous, turn_id, old, claim = reply[:7]
        orphan = reply[7] if len(reply) > 7 else ""  # a result replayed from an older script
        return Recorded(
            session_id=_text(sid),
            finalized_turn_id=_text(tid) or None,
            history_mismatch=bool(mismatched),
            ambiguous=bool(ambiguous),
            turn_id=_text(turn_id) or None,
            superseded_turn_id=_text(old) or None,
            claim_ambiguous=bool(claim),
            orphaned_turn_id=_text(orphan) or None,
        )

    async def finalize(
        self, request_id: str, member: str, extra: bytes, idle_cutoff: float | None = None
    ) -> str | None:
        """Publish the pending turn of session `member` (session_member) with `extra` appended;
        its turn id, or None when there was none (or, with a cutoff, the session was touched
        after it)."""
        tid = await self._scripts["finalize"](
            keys=self._keys(request_id, "finalize", member),
            args=[
                "",
                member,
                self.maxlen,
                extra,
                "" if idle_cutoff is None else idle_cutoff,
                self.dedupe_ttl_s,
            ],
        )
        return _text(tid) or None

    async def idle_sessions(self, cutoff: float, limit: int) -> list[str]:
        """Up to `limit` session members last active at or before `cutoff`, from every shard."""
        found: list[str] = []
        for key in self.active_keys:
            if len(found) < limit:
                async with self._bounded():
                    ids = await self.redis.zrangebyscore(key, "-inf", cutoff, 0, limit - len(found))
                found += [_text(s) for s in ids]
        return found

    async def active_count(self) -> int:
        async with self._bounded():
            return sum([int(await self.redis.zcard(key)) for key in self.active_keys])


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)
