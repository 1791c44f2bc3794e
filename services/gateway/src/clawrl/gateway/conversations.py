"""The conversations `previous_response_id` continues: a stored Responses-API response is its
conversation so far (input and output items as chat messages, instructions excepted: OpenAI
does not carry them over), its owner and its session, kept for the sessions' TTL. A
continuation then renders, records and matches its session exactly like a client that resent
the whole history.

A conversation is stored once, not once per response (which made a session of n turns cost
O(n^2) bytes): a thread, the list `{prefix}:conv:{first response id}`, holds one entry per
response, that response's own new items and reply; `{prefix}:resp:{response_id}` names its
owner, session, thread and how many entries of the thread are its conversation. A response
that continues the newest one of its thread appends its entry (one script, atomic: it checks
the thread's length); one that continues an older response (a branch), or that races another
continuation of the same response and loses, starts a thread of its own with its whole
conversation in one entry. Storing costs one script and one SET, continuing one GET and one
LRANGE; every command touches one key, so any Redis Cluster slot serves it. Responses stored
before threads (`[owner, session, messages]`) are still read, and continued into a new
thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from clawrl.common.redis_client import Script
from clawrl.gateway.errors import StoreUnavailable
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.recording import RECORDING_ERRORS

log = logging.getLogger(__name__)


# KEYS[1] the thread; ARGV: its length expected before the append (0: a new thread), the TTL,
# then the entries. Returns the thread's new length, or -1 when it was not that long.
APPEND = """
if redis.call('LLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return -1 end
local length = redis.call('RPUSH', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return length
"""


@dataclass(frozen=True)
class StoredConversation:
    owner: str  # caller_scope of the API key that made it: nobody else may continue it
    session_id: str | None  # the session its turn was recorded in (None: a side turn)
    messages: list[dict[str, Any]]  # chat-completions shaped, its reply last
    thread: str | None = None  # the thread it is stored in (None: not stored in one)
    length: int = 0  # how many entries of the thread are its conversation


class ConversationStore:
    def __init__(
        self, redis: Redis, metrics: GatewayMetrics, *, prefix: str, ttl_s: int, retry_after_s: int
    ):
        self.redis = redis
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._append = Script(redis, APPEND)

    def key(self, response_id: str) -> str:
        return f"{self.prefix}:resp:{response_id}"

    def thread_key(self, thread: str) -> str:
        return f"{self.prefix}:conv:{thread}"

    async def save(
        self,
        response_id: str,
        conversation: StoredConversation,
        parent: StoredConversation | None = None,
    ) -> None:
        """Store a response for its continuations: what it adds to `parent` (the stored
        response it continued, whose messages begin its own), appended to parent's thread when
        parent is that thread's newest response, else a thread of its own. Redis trouble does
        not fail the response (it was served): the failure is counted and logged, and
        continuing from it gets 400."""
        try:
            thread, length = await self._store_thread(response_id, conversation, parent)
            value = {"owner": conversation.owner, "session_id": conversation.session_id,
                     "thread": thread, "length": length}  # fmt: skip
            await self.redis.set(self.key(response_id), orjson.dumps(value), ex=self.ttl_s)
        except RECORDING_ERRORS as exc:
            self.metrics.recording_failures.labels("response_store").inc()
            log.warning(
                "response %s not stored (previous_response_id cannot continue it): %s: %s",
                response_id,
                type(exc).__name__,
                exc,
                extra={"session_id": conversation.session_id},
            )

    async def _store_thread(
        self, response_id: str, conversation: StoredConversation, parent: StoredConversation | None
    ) -> tuple[str, int]:
        """(thread, length) of the stored conversation."""
        if parent is not None and parent.thread is not None:
            added = orjson.dumps(conversation.messages[len(parent.messages) :])
            keys = [self.thread_key(parent.thread)]
            length = await self._append(keys, [parent.length, self.ttl_s, added])
            if length != -1:
                return parent.thread, int(length)
        whole = orjson.dumps(conversation.messages)
        await self._append([self.thread_key(response_id)], [0, self.ttl_s, whole])
        return response_id, 1

    async def load(self, response_id: str, owner: str) -> StoredConversation | None:
        """The stored response, or None when there is none or another caller made it (the two
        are not told apart, so an id reveals nothing about other callers)."""
        try:
            return await self._load(response_id, owner)
        except RECORDING_ERRORS as exc:
            self.metrics.recording_failures.labels("response_load").inc()
            raise StoreUnavailable(
                f"cannot read the stored response {response_id!r} now: {type(exc).__name__}",
                param="previous_response_id",
                retry_after_s=self.retry_after_s,
            ) from None

    async def _load(self, response_id: str, owner: str) -> StoredConversation | None:
        value = await self.redis.get(self.key(response_id))
        if value is None:
            return None
        stored = orjson.loads(value)
        if isinstance(stored, list):  # stored before threads: [owner, session, messages]
            return StoredConversation(owner, stored[1], stored[2]) if stored[0] == owner else None
        if stored["owner"] != owner:
            return None
        thread, length = stored["thread"], stored["length"]
        entries = await self.redis.lrange(self.thread_key(thread), 0, length - 1)
        if len(entries) < length:  # the thread expired first (by a moment): so did it
            return None
        messages = [message for entry in entries for message in orjson.loads(entry)]
        return StoredConversation(owner, stored["session_id"], messages, thread, length)
