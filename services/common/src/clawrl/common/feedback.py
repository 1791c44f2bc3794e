"""Explicit feedback on a turn: a user's reward, thumbs and/or comment, taken by the gateway's
`POST /v1/feedback` and merged by the judge into the turn's sample. This module holds what both
sides share: the `[feedback]` settings section (both services read it), where a turn's feedback
lives in Redis, and one feedback as stored.

Redis layout:
- `{key_prefix}:{turn_id}` hash, kept `ttl_s`: `f:<feedback_id>` -> a feedback that arrived
  before the turn's sample was published (the judge merges these), `l:<feedback_id>` -> one
  that arrived after (late: never merged; written to the audit trail and counted instead).
  Which of the two a feedback becomes is decided atomically against the judge's done marker
  (`judged_marker`), which is set in the same step that publishes the sample; and that step
  turns any `f:` entry the judge did not read (it arrived while the turn was judged) into a
  late one. So a feedback is either merged or audited as late, never lost.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Literal

import orjson
from pydantic import Field

from clawrl.common.settings import Section

Combine = Literal["override", "weighted"]
Thumbs = Literal["up", "down"]
THUMBS_REWARD = {"up": 1.0, "down": -1.0}
MERGED, LATE = "f:", "l:"  # field prefixes of the feedback hash


class FeedbackSettings(Section):
    """Explicit feedback (`POST /v1/feedback`): the gateway stores it, the judge merges it."""

    enabled: bool = Field(
        True,
        description="Gateway: serve POST /v1/feedback and keep each main turn's response id "
        "ratable; judge: read a turn's feedback before judging it.",
    )
    combine: Combine = Field(
        "override",
        description="Judge: how an explicit reward (or thumbs: up = +1, down = -1) meets the "
        "judge's own score in rl and combine modes. override: the explicit reward replaces it "
        "(the PRM is not asked); weighted: weight * explicit + (1 - weight) * judge score.",
    )
    weight: float = Field(
        0.5, ge=0, le=1, description="Judge, combine=weighted: the explicit reward's weight."
    )
    comment_as_hint: bool = Field(
        True,
        description="Judge, opd and combine modes: a feedback comment is the hindsight hint "
        "(the hint votes are not asked), so the teacher scores the reply with it.",
    )
    key_prefix: str = Field(
        "clawrl:feedback", description="Prefix of the per-turn feedback hashes in Redis."
    )
    ttl_s: int = Field(
        7 * 86400,
        gt=0,
        description="How long a turn stays ratable by its response id, and its feedback kept.",
    )
    max_comment_chars: int = Field(
        8000, gt=0, description="Gateway: a longer comment is refused (400)."
    )
    judge_key_prefix: str = Field(
        "clawrl:judge",
        description="The judge's workers.key_prefix: the gateway reads the judge's done "
        "markers there to tell late feedback (the judge refuses to start if they differ).",
    )
    audit_stream: str = Field(
        "clawrl:judgements",
        description="The judge's audit.stream, where the gateway writes late feedback (the "
        "judge refuses to start if they differ).",
    )


def feedback_key(prefix: str, turn_id: str) -> str:
    return f"{prefix}:{turn_id}"


def judged_marker(judge_prefix: str, turn_id: str) -> str:
    """The judge's "sample published" marker of a turn (JudgeStore.done_key)."""
    return f"{judge_prefix}:done:{turn_id}"


@dataclass(frozen=True)
class Feedback:
    """One feedback as stored (JSON in the turn's feedback hash)."""

    id: str
    reward: float | None = None  # in [-1, 1]
    thumbs: Thumbs | None = None
    comment: str | None = None
    at: float = 0.0  # when the gateway took it (unix seconds)

    @property
    def explicit_reward(self) -> float | None:
        """The reward it gives: `reward`, else its thumbs as +-1, else None (comment only)."""
        if self.reward is not None:
            return self.reward
        return THUMBS_REWARD[self.thumbs] if self.thumbs else None

    def content(self) -> tuple:
        """What a retry with the same id must repeat (the time is the first try's)."""
        return (self.reward, self.thumbs, self.comment)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | str) -> Feedback:
        value = orjson.loads(data)
        return cls(**{k: value.get(k) for k in ("id", "reward", "thumbs", "comment")},
                   at=float(value.get("at") or 0.0))  # fmt: skip


def content_id(turn_id: str, reward: float | None, thumbs: str | None, comment: str | None) -> str:
    """The id of a feedback whose client gave none: a retried POST with the same content on the
    same turn gets the same id, so it is recognised and not stored twice."""
    digest = hashlib.blake2b(orjson.dumps([turn_id, reward, thumbs, comment]), digest_size=12)
    return "fb-" + digest.hexdigest()
