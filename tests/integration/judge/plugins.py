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


# Hint plug-ins (judging.hint_fn) for the hint-source tests.


def hint_by_next_message(turn: TurnView) -> str | list[str] | None:
    """What the user's next message asks for: "plugin" -> one hint, "many" -> three candidates
    (one twice, in other case and spacing), "crash" -> raises, "garbage" -> not text, else None."""
    said = turn.next_user_text()
    if "plugin" in said:
        return "Hint from the plug-in: answer with the number only."
    if "many" in said:
        return [
            "Answer with the number only.",
            "answer with  the number ONLY.",
            "Reply in one short sentence that ends with the number.",
            "Be brief.",
        ]
    if "crash" in said:
        raise RuntimeError("hint plug-in bug")
    if "garbage" in said:
        return 42  # type: ignore[return-value]
    return None
