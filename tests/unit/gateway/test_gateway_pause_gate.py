"""The pause gate: holding, draining, releasing with the new version, hold timeout."""

import asyncio

import pytest

from clawrl.gateway.control import PauseGate, PauseHeld
from clawrl.gateway.errors import Overloaded
from clawrl.gateway.metrics import GatewayMetrics


def metric(gate, name):
    return gate.metrics.registry.get_sample_value(name)


def make_gate(hold_timeout_s=5.0):
    return PauseGate(GatewayMetrics(), hold_timeout_s=hold_timeout_s, retry_after_s=2)


async def test_pause_drains_in_flight_then_holds_new_work_until_resume():
    gate = make_gate()
    finish = asyncio.Event()

    async def generation():
        async with gate.admit() as admitted:
            await finish.wait()
            return admitted.policy_version

    running = asyncio.create_task(generation())
    await asyncio.sleep(0)
    assert gate.in_flight == 1
    pause = asyncio.create_task(gate.pause(5))
    await asyncio.sleep(0.01)
    assert not pause.done() and gate.paused

    async def later():
        async with gate.admit() as admitted:
            return admitted.policy_version

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


async def test_lease_expiry_resumes_on_the_current_version_and_is_counted():
    gate = make_gate()
    gate.set_policy_version(4)
    assert await gate.pause(1, lease_s=0.1, holder="sync-a") is True
    assert gate.paused and gate.holder == "sync-a" and 0 < gate.lease_remaining_s() <= 0.1

    async def later():
        async with gate.admit() as admitted:
            return admitted.policy_version

    held = asyncio.create_task(later())
    await asyncio.sleep(0.02)
    assert gate.held == 1
    # Nobody renews or resumes: the lease ends the pause by itself.
    assert await asyncio.wait_for(held, 2) == 4
    assert not gate.paused and gate.holder == "" and gate.lease_remaining_s() == 0
    assert metric(gate, "clawrl_gateway_pause_lease_expiries_total") == 1
    assert metric(gate, "clawrl_gateway_paused") == 0


async def test_same_holder_renews_the_lease_another_holder_is_refused():
    gate = make_gate()
    # A lease well beyond the renewal interval: a loaded host delays the loop's timers.
    await gate.pause(1, lease_s=0.5, holder="sync-a")
    for _ in range(8):  # 0.8 s in all, well past one lease: renewals keep it paused
        await asyncio.sleep(0.1)
        assert gate.paused
        await gate.pause(1, lease_s=0.5, holder="sync-a")
    with pytest.raises(PauseHeld, match="sync-a"):
        await gate.pause(1, lease_s=5, holder="sync-b")
    assert gate.holder == "sync-a" and metric(gate, "clawrl_gateway_pause_refusals_total") == 1
    assert metric(gate, "clawrl_gateway_pause_lease_expiries_total") == 0
    gate.resume(9)
    # The resumed gate's old lease timer is gone: nothing expires later (past its end).
    await asyncio.sleep(0.6)
    assert (
        metric(gate, "clawrl_gateway_pause_lease_expiries_total") == 0 and gate.policy_version == 9
    )


async def test_resume_is_idempotent():
    gate = make_gate()
    await gate.pause(1, lease_s=5, holder="sync-a")
    assert gate.resume(3) == 0
    assert gate.resume(3) == 0 and gate.resume(None) == 0
    assert not gate.paused and gate.policy_version == 3
    # A new holder may pause once the previous pause ended.
    await gate.pause(1, lease_s=5, holder="sync-b")
    assert gate.holder == "sync-b"
    gate.resume(None)


async def test_default_lease_applies_when_none_is_given():
    gate = PauseGate(GatewayMetrics(), hold_timeout_s=5, retry_after_s=2, lease_s=0.05)
    await gate.pause(1)
    await asyncio.sleep(0.15)
    assert not gate.paused and metric(gate, "clawrl_gateway_pause_lease_expiries_total") == 1


async def test_switch_changes_only_later_admissions_and_counts_in_flight_by_adapter():
    gate = make_gate()
    gate.set_policy_version(3)
    finish = asyncio.Event()
    admitted = []

    async def generation():
        async with gate.admit() as admission:
            admitted.append(admission)
            await finish.wait()

    running = [asyncio.create_task(generation())]
    await asyncio.sleep(0)
    gate.switch(4, "policy-v4")  # no pause: nothing is held, the running one keeps v3
    assert not gate.paused
    running += [asyncio.create_task(generation()) for _ in range(2)]
    await asyncio.sleep(0)
    assert [(a.policy_version, a.adapter) for a in admitted] == [
        (3, ""),
        (4, "policy-v4"),
        (4, "policy-v4"),
    ]
    assert gate.in_flight == 3 and dict(gate.in_flight_by_adapter) == {"": 1, "policy-v4": 2}
    finish.set()
    await asyncio.gather(*running)
    assert gate.in_flight == 0 and dict(gate.in_flight_by_adapter) == {}
    assert metric(gate, "clawrl_gateway_adapter_switches_total") == 1
    assert metric(gate, "clawrl_gateway_policy_version") == 4
    # A full-weight version resumed with drops the adapter.
    gate.resume(5)
    assert (gate.policy_version, gate.adapter) == (5, "")
