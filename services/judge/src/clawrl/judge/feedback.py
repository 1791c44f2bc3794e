"""Explicit feedback in the judge: the feedback a user gave a turn before its sample was
published (stored by the gateway's POST /v1/feedback, see clawrl.common.feedback), and how it
meets the judge's own score. The merge is pure; reading is one HGETALL per turn.

Several feedbacks on one turn: the latest reward (or thumbs) wins, and the latest comment."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from clawrl.common.feedback import MERGED, Combine, Feedback, feedback_key


@dataclass(frozen=True)
class TurnFeedback:
    """A turn's feedback as the judge read it, oldest first."""

    entries: tuple[Feedback, ...] = ()

    @property
    def ids(self) -> list[str]:
        return [entry.id for entry in self.entries]

    @property
    def reward(self) -> float | None:
        """The latest explicit reward (thumbs as +-1); None when none gave one."""
        for entry in reversed(self.entries):
            if entry.explicit_reward is not None:
                return entry.explicit_reward
        return None

    @property
    def comment(self) -> str:
        """The latest comment, "" when none."""
        for entry in reversed(self.entries):
            if entry.comment:
                return entry.comment
        return ""

    def audit(self) -> dict[str, Any]:
        return {
            "entries": [
                {"id": e.id, "reward": e.reward, "thumbs": e.thumbs, "comment": e.comment,
                 "at": e.at}
                for e in self.entries
            ],
            "reward": self.reward,
        }  # fmt: skip


def merged_reward(explicit: float, judged: float | None, combine: Combine, weight: float) -> float:
    """The reward of a turn with an explicit one. override: the explicit reward; weighted:
    weight * explicit + (1 - weight) * judged, or the explicit reward alone when the judge has
    no score (no next state to judge)."""
    if combine == "override" or judged is None:
        return explicit
    return weight * explicit + (1.0 - weight) * judged


def ordered(entries: Sequence[Feedback]) -> tuple[Feedback, ...]:
    """Feedback in the order it arrived (ties by id, so every reader agrees)."""
    return tuple(sorted(entries, key=lambda e: (e.at, e.id)))


async def read_feedback(redis: Redis, prefix: str, turn_id: str) -> TurnFeedback:
    """The feedback stored for a turn that the judge merges (late ones excluded)."""
    fields = await redis.hgetall(feedback_key(prefix, turn_id))
    entries = []
    for name, value in fields.items():
        name = name.decode() if isinstance(name, bytes) else name
        if name.startswith(MERGED):
            entries.append(Feedback.from_json(value))
    return TurnFeedback(ordered(entries))
