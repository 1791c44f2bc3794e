"""POST /v1/feedback: a user rates one of its turns (a reward in [-1, 1], thumbs up or down,
and/or a comment), named by the response id its client got back or by its session (the latest
turn unless `turn_index` says which).

Only the caller that made the turn may rate it (the same API key and `user` as the request:
`caller_scope`); any other caller gets the 404 of an id that does not exist, so nobody learns
which ids exist. By session id, the sender's own session of that id is read (sessions are per
caller, sessions.py): another caller's turns are not in it, whatever session id they share. A
POST is idempotent by its feedback id (`Idempotency-Key` header, body `feedback_id`, else a hash
of the turn and the content): a retry gets the first answer and stores nothing twice; reusing an
id for other content is a 409.

Where it goes (clawrl.common.feedback): before the judge published the turn's sample, into the
turn's feedback hash, which the judge merges; after, it is late: kept, written to the audit
trail and counted, in the same atomic step that decided it was late."""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import Field, StrictInt, StrictStr, ValidationError, field_validator
from redis.asyncio import Redis

from clawrl.common import records
from clawrl.common.feedback import (
    Feedback,
    FeedbackSettings,
    Thumbs,
    content_id,
    feedback_key,
    judged_marker,
)
from clawrl.common.redis_client import REDIS_ERRORS, Script
from clawrl.gateway.errors import GatewayError, InvalidRequest, NotFound
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.protocol import (
    Number,
    _fail,
    _Model,
    api_credential,
    invalid_request,
    parse_body,
)
from clawrl.gateway.sessions import SessionStore, caller_scope

log = logging.getLogger(__name__)

FEEDBACK_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

# KEYS: the turn's feedback hash, the judge's done marker of the turn, the audit stream.
# ARGV: feedback id, feedback JSON, ttl, audit maxlen, audit record head (JSON without its
#       closing brace), turn id. Field prefixes f: (merged) and l: (late) as in common.feedback.
# Returns {status, stored JSON}: accepted | late, or duplicate-accepted | duplicate-late when
# the id was stored before (a retry: nothing is written).
STORE = """
local earlier = redis.call('HGET', KEYS[1], 'f:' .. ARGV[1])
if earlier then return {'duplicate-accepted', earlier} end
earlier = redis.call('HGET', KEYS[1], 'l:' .. ARGV[1])
if earlier then return {'duplicate-late', earlier} end
local sample_entry = redis.call('GET', KEYS[2])
local status = 'accepted'
if sample_entry then
  -- The sample is published: nothing merges this any more. Kept, and audited as late.
  status = 'late'
  redis.call('HSET', KEYS[1], 'l:' .. ARGV[1], ARGV[2])
  local record = ARGV[5] .. ',"sample_entry":"' .. sample_entry .. '","late_feedback":['
    .. ARGV[2] .. ']}'
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'id', ARGV[6],
    'outcome', 'late_feedback', 'data', record)
else
  redis.call('HSET', KEYS[1], 'f:' .. ARGV[1], ARGV[2])
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {status, ARGV[2]}
"""
AUDIT_MAXLEN = 200_000  # the judge's default retention.audit_maxlen: a backstop, XADD ~


class FeedbackUnavailable(GatewayError):
    """Redis did not answer: the feedback is not stored, the client may retry (idempotent)."""

    status = 503
    type = "api_error"
    code = "feedback_unavailable"


class FeedbackConflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_reused"


class FeedbackBody(_Model):
    """The body of POST /v1/feedback."""

    model_config = {**_Model.model_config, "extra": "forbid"}

    response_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    session_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    turn_index: StrictInt | None = Field(None, ge=0)
    reward: Number | None = None
    thumbs: Thumbs | None = None
    comment: StrictStr | None = None
    feedback_id: StrictStr | None = None
    user: StrictStr | None = None

    @field_validator("reward", mode="before")
    @classmethod
    def _in_range(cls, value: Any) -> Any:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and not (number and math.isfinite(value) and -1 <= value <= 1):
            raise _fail("must be a number between -1 and 1, got {value}", value=repr(value))
        return value


@dataclass(frozen=True)
class FeedbackRequest:
    """A validated feedback: which turn (response id, or session and turn index), what it says,
    and who sent it."""

    response_id: str | None
    session_id: str | None
    turn_index: int | None  # None: the session's latest turn
    reward: float | None
    thumbs: str | None
    comment: str | None
    feedback_id: str | None  # None: derived from the content once the turn is known
    scope: str  # caller_scope of the sender

    def target(self) -> str:
        if self.response_id is not None:
            return f"response id {self.response_id!r}"
        which = "latest turn" if self.turn_index is None else f"turn {self.turn_index}"
        return f"{which} of session {self.session_id!r}"


def request_scope(headers: Mapping[str, str], user: str | None) -> str:
    """The caller as the serving routes record it: its API key and `user`."""
    return caller_scope(api_credential(headers), user)


def parse_feedback(
    body: bytes, headers: Mapping[str, str], max_comment_chars: int
) -> FeedbackRequest:
    """Validate a POST /v1/feedback body (400 with the reason otherwise). Pure."""
    data = parse_body(body)
    try:
        parsed = FeedbackBody.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    if (parsed.response_id is None) == (parsed.session_id is None):
        raise InvalidRequest(
            "name the turn to rate with exactly one of 'response_id' (the id of the response "
            "you got) and 'session_id'",
            param="response_id",
        )
    if parsed.turn_index is not None and parsed.session_id is None:
        raise InvalidRequest("'turn_index' goes with 'session_id'", param="turn_index")
    comment = parsed.comment.strip() if parsed.comment is not None else None
    if parsed.reward is None and parsed.thumbs is None and not comment:
        raise InvalidRequest(
            "give at least one of 'reward' (a number in [-1, 1]), 'thumbs' ('up' or 'down') "
            "and 'comment' (a non-empty string)"
        )
    if comment is not None and len(comment) > max_comment_chars:
        raise InvalidRequest(
            f"comment is {len(comment)} characters long; the limit is {max_comment_chars}",
            param="comment",
        )
    reward = None if parsed.reward is None else float(parsed.reward)
    if reward is not None and parsed.thumbs is not None:
        thumb = 1.0 if parsed.thumbs == "up" else -1.0
        if reward * thumb < 0:
            raise InvalidRequest(
                f"thumbs {parsed.thumbs!r} contradicts reward {reward:g}: send one or agree",
                param="thumbs",
            )
    feedback_id = headers.get("idempotency-key") or parsed.feedback_id
    if feedback_id is not None and not FEEDBACK_ID.fullmatch(feedback_id):
        raise InvalidRequest(
            "the feedback id (Idempotency-Key or feedback_id) must be 1-128 characters of "
            "letters, digits and _ . : -",
            param="feedback_id",
        )
    return FeedbackRequest(
        response_id=parsed.response_id,
        session_id=parsed.session_id,
        turn_index=parsed.turn_index,
        reward=reward,
        thumbs=parsed.thumbs,
        comment=comment or None,
        feedback_id=feedback_id,
        scope=request_scope(headers, parsed.user),
    )


def owned(stored: str | bytes | None, scope: str) -> bool:
    """Whether the recorded caller scope is the sender's (constant time)."""
    if stored is None:
        return False
    text = stored.decode() if isinstance(stored, bytes) else stored
    return hmac.compare_digest(text.encode(), scope.encode())


class FeedbackService:
    """Finds the turn a feedback names, checks who sent it, and stores it."""

    def __init__(
        self,
        redis: Redis,
        sessions: SessionStore,
        settings: FeedbackSettings,
        metrics: GatewayMetrics,
    ) -> None:
        self.redis = redis
        self.sessions = sessions
        self.settings = settings
        self.metrics = metrics
        self._store = Script(redis, STORE)

    async def handle(self, body: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
        """One POST /v1/feedback (already authorised): the response body."""
        try:
            request = parse_feedback(body, headers, self.settings.max_comment_chars)
        except InvalidRequest:
            self.metrics.feedback.labels("invalid").inc()
            raise
        try:
            return await self.submit(request)
        except REDIS_ERRORS as exc:
            self.metrics.feedback.labels("unavailable").inc()
            log.warning("feedback on %s not stored, Redis failed: %s: %s", request.target(),
                        type(exc).__name__, exc)  # fmt: skip
            raise FeedbackUnavailable(
                "feedback could not be stored right now; retry it (with the same "
                "Idempotency-Key it is stored once)",
                retry_after_s=5,
            ) from exc

    async def submit(self, request: FeedbackRequest) -> dict[str, Any]:
        """Store one feedback; the response body. Raises NotFound, FeedbackConflict."""
        turn_id = await self._turn_id(request)
        feedback = Feedback(
            id=request.feedback_id
            or content_id(turn_id, request.reward, request.thumbs, request.comment),
            reward=request.reward,
            thumbs=request.thumbs,  # type: ignore[arg-type]
            comment=request.comment,
            at=time.time(),
        )
        status, stored = await self._store(
            keys=self._keys(turn_id),
            args=[
                feedback.id,
                feedback.to_json(),
                self.settings.ttl_s,
                AUDIT_MAXLEN,
                b'{"turn_id":' + orjson.dumps(turn_id),
                turn_id,
            ],
        )
        status = status.decode() if isinstance(status, bytes) else status
        first = Feedback.from_json(stored)
        if status.startswith("duplicate"):
            if first.content() != feedback.content():
                self.metrics.feedback.labels("conflict").inc()
                raise FeedbackConflict(
                    f"feedback id {feedback.id!r} was already used for different feedback on "
                    "this turn; use a new id for new feedback",
                    param="feedback_id",
                )
            self.metrics.feedback.labels("duplicate").inc()
            status = status.removeprefix("duplicate-")
        else:
            self.metrics.feedback.labels(status).inc()
            if status == "late":
                log.info("late feedback %s on turn %s (its sample was already published): "
                         "audited, not merged", feedback.id, turn_id)  # fmt: skip
        return {
            "id": first.id,
            "object": "feedback",
            "created": int(first.at),
            "turn_id": turn_id,
            "status": status,
            "reward": first.reward,
            "thumbs": first.thumbs,
            "comment": first.comment,
        }

    def _keys(self, turn_id: str) -> list[str]:
        """The store script's keys: all in the shard of the turn's session (common/shards.py),
        where the judge keeps its done marker and audit stream for the turn."""
        s, shards = self.settings, self.sessions.shards
        shard = shards.of(records.session_of(turn_id))
        return [
            feedback_key(shards.name(s.key_prefix, shard), turn_id),
            judged_marker(shards.name(s.judge_key_prefix, shard), turn_id),
            shards.name(s.audit_stream, shard),
        ]

    async def _turn_id(self, request: FeedbackRequest) -> str:
        """The turn the feedback names, when the sender made it; else the same 404 whether the
        turn does not exist or is someone else's."""
        missing = NotFound(f"no turn of yours matches {request.target()}", code="turn_not_found")
        if request.response_id is not None:
            # The index is in the shard of the turn's session, which the id does not tell.
            keys = [
                self.sessions.feedback_index_key(request.response_id, shard)
                for shard in range(self.sessions.shards.count)
            ]
            found = next((v for v in await gather_get(self.redis, keys) if v is not None), None)
            if found is None:
                return self._not_found(missing)
            found_id, _, scope = found.decode().partition("\n")
            return found_id if owned(scope, request.scope) else self._not_found(missing)
        assert request.session_id is not None
        epoch, next_index = await self.redis.hmget(
            self.sessions.session_key(request.session_id, request.scope), "epoch", "next"
        )
        if epoch is None or next_index is None:
            return self._not_found(missing)
        count = int(next_index)
        index = count - 1 if request.turn_index is None else request.turn_index
        if not 0 <= index < count:
            return self._not_found(missing)
        return records.turn_id(request.session_id, epoch.decode(), index)

    def _not_found(self, error: NotFound) -> str:
        self.metrics.feedback.labels("not_found").inc()
        raise error


async def gather_get(redis: Redis, keys: list[str]) -> list[bytes | None]:
    """GET of each key, concurrently (one MGET would span hash slots under Redis Cluster)."""
    return list(await asyncio.gather(*(redis.get(key) for key in keys)))
