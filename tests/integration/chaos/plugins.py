"""The chaos run's reward plug-in (importable by a judge started as a child process)."""

from __future__ import annotations

import asyncio

from clawrl.judge.turns import TurnView


async def slow_parity(turn: TurnView, *, delay_s: float = 0.3) -> float:
    """+1 for a reply of an even number of tokens, else -1, after `delay_s`: every turn is
    trainable, and each stays in progress long enough for a kill to find the judge mid-turn."""
    await asyncio.sleep(delay_s)
    return 1.0 if len(turn.turn.response_ids) % 2 == 0 else -1.0
