"""The pause gate: holding, draining, releasing with the new version, hold timeout."""

import asyncio

import pytest

from clawrl.gateway.control import PauseGate
from clawrl.gateway.errors import Overloaded
from clawrl.gateway.metrics import GatewayMetrics


def make_gate(hold_timeout_s=5.0):
    return PauseGate(GatewayMetrics(), hold_timeout_s=hold_timeout_s, retry_after_s=2)


async def test_pause_drains_in_flight_then_holds_new_work_until_resume():
    gate = make_gate()
    finish = asyncio.Event()

    async def generation():
        async with gate.admit() as version:
            await finish.wait()
            return version

    running = asyncio.create_task(generation())
    await asyncio.sleep(0)
    assert gate.in_flight == 1
    pause = asyncio.create_task(gate.pause(5))
    await asyncio.sleep(0.01)
    assert not pause.done() and gate.paused

    async def later():
        async with gate.admit() as version:
            return version

    held = asyncio.create_task(later())
    await asyncio.sleep(0.01)
    assert gate.held == 1 and not held.done()
    finish.set()
    assert await pause is True and await running == 0
    assert gate.resume(12) == 1
    assert await held == 12 and gate.held == 0 and gate.in_flight == 0


async def test_drain_timeout_reports_work_still_running():
    gate = make_gate()
    finish = asyncio.Event()

    async def generation():
        async with gate.admit():
            await finish.wait()

    task = asyncio.create_task(generation())
    await asyncio.sleep(0)
    assert await gate.pause(0.05) is False and gate.in_flight == 1
    finish.set()
    await task
    gate.resume(None)
    assert gate.policy_version == 0


async def test_hold_timeout_is_overloaded_with_retry_after():
    gate = make_gate(hold_timeout_s=0.05)
    await gate.pause(1)
    with pytest.raises(Overloaded) as info:
        async with gate.admit():
            pass
    assert info.value.retry_after_s == 2 and gate.held == 0 and gate.in_flight == 0
