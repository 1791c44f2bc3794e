"""Episode outcomes (Track 2): an agent that plays a task as a session of tool-using turns
(the agent runner) marks its requests `X-Episode: true`; once the episode ended and the task's
checker ran, it posts the outcome for the whole session (`POST /v1/outcomes` on the gateway).
The judge makes each turn of the episode wait for that outcome and merges it with the turn's own
step score (OpenClaw-RL's terminal-rl formula, `clawrl.judge.episodes.episode_score`). This
module holds what both sides share: the `[episodes]` settings section, where an episode's
outcome lives in Redis, and one outcome as stored.

Redis layout: `{key_prefix}:{session_id}:{epoch}` hash (the session state, `session_state_of`;
in the shard of the session id, like the session's other keys), kept `ttl_s`:
- `state`: the decision, written once (whoever comes first): the outcome's JSON (the gateway
  took it) or `expired` (the judge gave up waiting: every turn of the episode is masked, never
  trained with a made-up reward);
- `late`: an outcome posted after `expired` (kept, audited as `late_outcome` and counted);
- `active`: when a turn of the episode last began waiting at the judge (its clock, unix seconds):
  the episode expires `outcome_timeout_s` after that with no outcome, so the wait restarts with
  every turn the episode makes and only an episode that stopped for that long expires.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import orjson
from pydantic import Field

from clawrl.common.settings import Section

STATE, LATE, ACTIVE = "state", "late", "active"  # fields of the outcome hash
EXPIRED = "expired"  # the `state` the judge writes when it gives up waiting


class EpisodeSettings(Section):
    """Episodes and their outcomes (`X-Episode: true` requests, `POST /v1/outcomes`): the
    gateway records and stores them, the judge waits for and merges them."""

    enabled: bool = Field(
        True,
        description="Gateway: mark the turns of requests sent with X-Episode: true and serve POST "
        "/v1/outcomes; judge: make those turns wait for their episode's outcome (off: they are "
        "judged like any chat turn).",
    )
    prm_step_coef: float = Field(
        1.0,
        ge=0,
        description="Judge: the weight of a turn's own step score (PRM, reward_fn or explicit "
        "feedback) in reward = (2 * outcome - 1) + prm_step_coef * step_score (OpenClaw-RL's "
        "PRM_STEP_COEF, default 1.0); 0: the outcome alone (the PRM is not asked).",
    )
    outcome_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Judge: an episode with no outcome this long after its latest turn began "
        "waiting expires: its turns are masked (MASK_REASON_NO_OUTCOME), never trained. Longer "
        "than the slowest step of an episode plus its checker.",
    )
    poll_interval_s: float = Field(
        0.5, gt=0, description="Judge: how often waiting turns look for their outcome."
    )
    max_waiting: int = Field(
        4096,
        gt=0,
        description="Judge: turns that may wait for outcomes at once per worker (beside "
        "workers.concurrency, which counts the turns being judged); reading pauses at the cap.",
    )
    key_prefix: str = Field(
        "clawrl:outcome", description="Prefix of the per-episode outcome hashes in Redis."
    )
    ttl_s: int = Field(
        7 * 86400, gt=0, description="How long an episode's outcome (or expiry) is kept."
    )
    max_detail_chars: int = Field(
        8000,
        gt=100,
        description="Gateway: a longer outcome `detail` is kept cut in the middle (it is for the "
        "audit trail; a checker's long output must not cost the outcome).",
    )


def outcome_key(prefix: str, session_state: str) -> str:
    """The outcome hash of one session state (`{session_id}:{epoch}`)."""
    return f"{prefix}:{session_state}"


@dataclass(frozen=True)
class Outcome:
    """One episode's outcome as stored (the `state` or `late` field's JSON)."""

    outcome: float  # in [0, 1]: 1 success, 0 failure, or the checker's score
    task_id: str = ""  # the task the episode played ("" when not named)
    detail: str = ""  # what the checker said (audit only)
    at: float = 0.0  # when the gateway took it (unix seconds)

    def content(self) -> tuple:
        """What a retry must repeat (the time is the first post's)."""
        return (self.outcome, self.task_id, self.detail)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | str) -> Outcome:
        value = orjson.loads(data)
        return cls(
            outcome=float(value["outcome"]),
            task_id=str(value.get("task_id") or ""),
            detail=str(value.get("detail") or ""),
            at=float(value.get("at") or 0.0),
        )
