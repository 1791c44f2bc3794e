"""POST /v1/outcomes: the outcome of an episode (Track 2). An agent runner plays a task as one
session whose main requests say `X-Episode: true`; once the episode ended and the task's checker
ran, it posts the outcome for the whole session: `{"session_id", "outcome"}` with the outcome in
[0, 1] (1 success, 0 failure, or the checker's score), optionally the `task_id` (the step_wise
estimator normalises among the turns of one task) and the checker's `detail` (audited; cut in
the middle past episodes.max_detail_chars).

Who may post it: the caller that made the session (the same API key and `user` as its
requests): the sender's own session state of that id is read (sessions are per caller), so any
other caller gets the 404 of a session that does not exist. A session none of whose turns said
X-Episode is refused (409 not_an_episode): its turns were judged as chat turns, nothing would
merge the outcome. One outcome per episode: a retry with the same content gets the first
answer, another outcome is a 409.

Where it goes (clawrl.common.episodes): into the episode's outcome hash, atomically against the
judge's expiry. Before the judge gave up waiting, the episode's turns merge it; after, it is
late: kept, written to the audit trail (`late_outcome`) and counted, never merged. Posting the
outcome also ends the session: its pending last turn is finalised (session done), so it reaches
the judge now rather than at the idle timeout."""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import Field, StrictStr, ValidationError, field_validator
from redis.asyncio import Redis

from clawrl.common.episodes import EpisodeSettings, Outcome, outcome_key
from clawrl.common.redis_client import REDIS_ERRORS, Script
from clawrl.gateway.errors import GatewayError, InvalidRequest, NotFound
from clawrl.gateway.feedback import AUDIT_MAXLEN, request_scope
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.protocol import Number, _fail, _Model, invalid_request, parse_body
from clawrl.gateway.recording import Recorder
from clawrl.gateway.sessions import SessionStore

log = logging.getLogger(__name__)

OUTCOME_ROUTE = "/v1/outcomes"

# KEYS: the episode's outcome hash, the audit stream of its shard.
# ARGV: outcome JSON, ttl, audit maxlen, audit record head (JSON without its closing brace),
#       audit entry id (the session state).
# Fields as in clawrl.common.episodes: state (the outcome's JSON, or 'expired' once the judge
# gave up waiting), late (an outcome posted after that).
# Returns {status, stored JSON}: accepted | late, or duplicate-accepted | duplicate-late when an
# outcome was stored before (nothing is written).
STORE = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  redis.call('HSET', KEYS[1], 'state', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return {'accepted', ARGV[1]}
end
if state ~= 'expired' then return {'duplicate-accepted', state} end
local late = redis.call('HGET', KEYS[1], 'late')
if late then return {'duplicate-late', late} end
redis.call('HSET', KEYS[1], 'late', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'id', ARGV[5],
  'outcome', 'late_outcome', 'data', ARGV[4] .. ',"late_outcome":' .. ARGV[1] .. '}')
return {'late', ARGV[1]}
"""


class OutcomeUnavailable(GatewayError):
    """Redis did not answer: the outcome is not stored, the client may retry (idempotent)."""

    status = 503
    type = "api_error"
    code = "outcome_unavailable"


class OutcomeConflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "outcome_already_set"


class NotAnEpisode(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "not_an_episode"


class OutcomeBody(_Model):
    """The body of POST /v1/outcomes."""

    model_config = {**_Model.model_config, "extra": "forbid"}

    session_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    outcome: Number
    task_id: StrictStr | None = Field(None, max_length=256)  # "": none named
    detail: StrictStr | None = None
    user: StrictStr | None = None

    @field_validator("outcome", mode="before")
    @classmethod
    def _in_range(cls, value: Any) -> Any:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and 0 <= value <= 1):
            raise _fail(
                "must be a number between 0 and 1 (1 success, 0 failure, or the checker's "
                "score), got {value}",
                value=repr(value),
            )
        return value


@dataclass(frozen=True)
class OutcomeRequest:
    """A validated outcome: which session, what it says, and who sent it."""

    session_id: str
    outcome: float
    task_id: str
    detail: str
    scope: str  # caller_scope of the sender


def parse_outcome(body: bytes, headers: Mapping[str, str], max_detail_chars: int) -> OutcomeRequest:
    """Validate a POST /v1/outcomes body (400 with the reason otherwise). Pure. The session is
    the body's `session_id`, else the X-Session-Id header the runner's requests carry."""
    data = parse_body(body)
    try:
        parsed = OutcomeBody.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    session_id = parsed.session_id or headers.get("x-session-id", "").strip()
    if not session_id:
        raise InvalidRequest(
            "name the episode's session with 'session_id' (or the X-Session-Id header)",
            param="session_id",
        )
    return OutcomeRequest(
        session_id=session_id,
        outcome=float(parsed.outcome),
        task_id=parsed.task_id or "",
        detail=shortened(parsed.detail or "", max_detail_chars),
        scope=request_scope(headers, parsed.user),
    )


def shortened(text: str, limit: int) -> str:
    """`text` cut in the middle to at most `limit` characters, with a visible marker. The
    detail is for the audit trail only: a checker's long output must not cost the outcome."""
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} characters cut ...]\n"
    keep = max(limit - len(marker), 0)
    return text[: keep // 2] + marker + text[len(text) - (keep - keep // 2) :]


class OutcomeService:
    """Finds the episode an outcome names, checks who sent it, stores it and ends the
    session."""

    def __init__(
        self,
        redis: Redis,
        sessions: SessionStore,
        recorder: Recorder,
        settings: EpisodeSettings,
        audit_stream: str,
        metrics: GatewayMetrics,
    ) -> None:
        self.redis = redis
        self.sessions = sessions
        self.recorder = recorder
        self.settings = settings
        self.audit_stream = audit_stream  # the judge's (feedback.audit_stream), per shard
        self.metrics = metrics
        self._store = Script(redis, STORE)

    async def handle(self, body: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
        """One POST /v1/outcomes (already authorised): the response body."""
        try:
            request = parse_outcome(body, headers, self.settings.max_detail_chars)
        except InvalidRequest:
            self.metrics.outcomes.labels("invalid").inc()
            raise
        try:
            return await self.submit(request)
        except REDIS_ERRORS as exc:
            self.metrics.outcomes.labels("unavailable").inc()
            log.warning("outcome of session %r not stored, Redis failed: %s: %s",
                        request.session_id, type(exc).__name__, exc)  # fmt: skip
            raise OutcomeUnavailable(
                "the outcome could not be stored right now; retry it (the same outcome is "
                "stored once)",
                retry_after_s=5,
            ) from exc

    async def submit(self, request: OutcomeRequest) -> dict[str, Any]:
        """Store one outcome, then close the session; the response body. Raises NotFound,
        NotAnEpisode, OutcomeConflict."""
        state, turns = await self._episode(request)
        outcome = Outcome(request.outcome, request.task_id, request.detail, at=time.time())
        shard = self.sessions.shards.of(request.session_id)
        head = {"session_id": request.session_id, "session_state": state}
        status, stored = await self._store(
            keys=[
                outcome_key(self.sessions.shards.name(self.settings.key_prefix, shard), state),
                self.sessions.shards.name(self.audit_stream, shard),
            ],
            args=[
                outcome.to_json(),
                self.settings.ttl_s,
                AUDIT_MAXLEN,
                orjson.dumps(head)[:-1],
                state,
            ],
        )
        status = status.decode() if isinstance(status, bytes) else status
        first = Outcome.from_json(stored)
        if status.startswith("duplicate"):
            if first.content() != outcome.content():
                self.metrics.outcomes.labels("conflict").inc()
                raise OutcomeConflict(
                    f"session {request.session_id!r} already has the outcome {first.outcome:g}; "
                    "an episode has one outcome",
                    param="outcome",
                )
            self.metrics.outcomes.labels("duplicate").inc()
            status = status.removeprefix("duplicate-")
        else:
            self.metrics.outcomes.labels(status).inc()
            if status == "late":
                log.info("late outcome for session %s: its turns were masked (no outcome in "
                         "time); audited, not merged", state)  # fmt: skip
        # The episode is over: its last turn, pending until now, goes to the judge.
        await self.recorder.close(f"outcome-{uuid.uuid4().hex}", request.session_id, request.scope)
        return {
            "object": "episode.outcome",
            "session_id": request.session_id,
            "status": status,
            "outcome": first.outcome,
            "task_id": first.task_id or None,
            "turns": turns,
            "created": int(first.at),
        }

    async def _episode(self, request: OutcomeRequest) -> tuple[str, int]:
        """(the session state `{session_id}:{epoch}`, its turn count) of the sender's session;
        else the same 404 whether it does not exist or is someone else's."""
        key = self.sessions.session_key(request.session_id, request.scope)
        epoch, count, episode = await self.redis.hmget(key, "epoch", "next", "episode")
        if epoch is None or count is None:
            self.metrics.outcomes.labels("not_found").inc()
            raise NotFound(
                f"no session of yours matches {request.session_id!r}", code="session_not_found"
            )
        if episode is None:
            self.metrics.outcomes.labels("not_episode").inc()
            raise NotAnEpisode(
                f"session {request.session_id!r} is not an episode: none of its requests said "
                "X-Episode: true, so its turns were judged as chat turns and nothing would merge "
                "an outcome; send the header on every request of an episode",
                param="session_id",
            )
        return f"{request.session_id}:{epoch.decode()}", int(count)
