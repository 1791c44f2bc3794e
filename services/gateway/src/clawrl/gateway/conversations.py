"""The conversations `previous_response_id` continues: each stored Responses-API response is its
conversation so far (input and output items as chat messages, instructions excepted: OpenAI
does not carry them over), its owner and its session, under `{prefix}:resp:{response_id}` with
the sessions' TTL. A continuation then renders, records and matches its session exactly like a
client that resent the whole history.

One key per response, one SET to store it and one GET to continue from it: a client may
continue from any earlier response (a branch), not only the newest, and a key holds one
response only, so it lives in any Redis Cluster slot."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from clawrl.gateway.errors import StoreUnavailable
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.recording import RECORDING_ERRORS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredConversation:
    owner: str  # caller_scope of the API key that made it: nobody else may continue it
    session_id: str | None  # the session its turn was recorded in (None: a side turn)
    messages: list[dict[str, Any]]  # chat-completions shaped, its reply last


class ConversationStore:
    def __init__(
        self, redis: Redis, metrics: GatewayMetrics, *, prefix: str, ttl_s: int, retry_after_s: int
    ):
        self.redis = redis
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.prefix = prefix
        self.ttl_s = ttl_s

    def key(self, response_id: str) -> str:
        return f"{self.prefix}:resp:{response_id}"

    async def save(self, response_id: str, conversation: StoredConversation) -> None:
        """Store a response for its continuations. Redis trouble does not fail the response
        (it was served): the failure is counted and logged, and continuing from it gets 400."""
        value = orjson.dumps([conversation.owner, conversation.session_id, conversation.messages])
        try:
            await self.redis.set(self.key(response_id), value, ex=self.ttl_s)
        except RECORDING_ERRORS as exc:
            self.metrics.recording_failures.labels("response_store").inc()
            log.warning(
                "response %s not stored (previous_response_id cannot continue it): %s: %s",
                response_id,
                type(exc).__name__,
                exc,
                extra={"session_id": conversation.session_id},
            )

    async def load(self, response_id: str, owner: str) -> StoredConversation | None:
        """The stored response, or None when there is none or another caller made it (the two
        are not told apart, so an id reveals nothing about other callers)."""
        try:
            value = await self.redis.get(self.key(response_id))
        except RECORDING_ERRORS as exc:
            self.metrics.recording_failures.labels("response_load").inc()
            raise StoreUnavailable(
                f"cannot read the stored response {response_id!r} now: {type(exc).__name__}",
                param="previous_response_id",
                retry_after_s=self.retry_after_s,
            ) from None
        if value is None:
            return None
        stored_owner, session_id, messages = orjson.loads(value)
        if stored_owner != owner:
            return None
        return StoredConversation(stored_owner, session_id, messages)
