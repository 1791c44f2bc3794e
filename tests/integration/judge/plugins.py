"""Reward plug-ins for the judge tests (importable by a judge started as a child process)."""

from __future__ import annotations

import asyncio

from clawrl.judge.turns import TurnView


async def never(turn: TurnView) -> float:
    """Hangs: the turn stays in progress until the worker is killed."""
    await asyncio.Event().wait()
    return 0.0


def by_response(turn: TurnView) -> float | None:
    """The reward written in the reply: "+1", "-1", "0"; None otherwise."""
    return {"+1": 1.0, "-1": -1.0, "0": 0.0}.get(turn.response_text.strip())


def fails(turn: TurnView) -> float:
    raise RuntimeError("plug-in bug")


def not_a_number(turn: TurnView) -> str:
    return "high"
