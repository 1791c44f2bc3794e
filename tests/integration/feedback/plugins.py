"""A reward plug-in for the feedback tests that holds a turn mid-judgement until the test lets
it go (the judge runs in the test's process, so the events are shared)."""

from __future__ import annotations

import asyncio

from clawrl.judge.turns import TurnView

started = asyncio.Event()  # set once a turn is being judged
release = asyncio.Event()  # the judgement finishes once set


async def held(turn: TurnView) -> float:
    started.set()
    await release.wait()
    return 1.0
