"""The lease pool's rules with a hand-moved clock, over the real local backend (bubblewrap
sandboxes take ~0.1 s): expiry, a busy lease outliving its TTL, a full pool making room from
expired leases, a refused reset, a close during a command."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from clawrl.environments.backend import Limits
from clawrl.environments.leases import (
    BadTask,
    LeaseError,
    LeaseNotFound,
    LeasePool,
    NotReset,
    PoolExhausted,
)
from clawrl.environments.local import LocalBackend
from clawrl.environments.metrics import EnvironmentsMetrics
from clawrl.environments.protocol import TaskMeta
from clawrl.environments.settings import LeaseSettings, LocalSandboxSettings
from tests.sandbox_service import sandbox_root

TTL = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def pool() -> AsyncIterator[LeasePool]:
    root = sandbox_root()
    backend = LocalBackend(LocalSandboxSettings(root_dir=root))
    await backend.probe()
    settings = LeaseSettings(max_leases=2, ttl_s=TTL)
    lease_pool = LeasePool(backend, settings, Limits(), Limits(), EnvironmentsMetrics(), Clock())
    yield lease_pool
    await lease_pool.shutdown()
    await backend.aclose()
    shutil.rmtree(root, ignore_errors=True)


def sample(pool: LeasePool, name: str, **labels: str) -> float:
    value = pool.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def sandbox_dir(pool: LeasePool, lease_id: str) -> Path:
    return pool.backend.root / lease_id  # type: ignore[attr-defined]


async def test_a_lease_expires_without_calls(pool: LeasePool) -> None:
    lease, reused = await pool.allocate("t", None)
    assert not reused
    await pool.reset(lease.lease_id, TaskMeta(files={"a": "1"}))
    assert sandbox_dir(pool, lease.lease_id).is_dir()
    pool.clock.now += TTL - 1  # type: ignore[attr-defined]
    await pool.heartbeat(lease.lease_id)  # renewed: TTL from now
    pool.clock.now += TTL - 1  # type: ignore[attr-defined]
    assert await pool.reap_expired() == 0
    pool.clock.now += 2  # type: ignore[attr-defined]
    assert await pool.reap_expired() == 1
    assert not sandbox_dir(pool, lease.lease_id).exists()
    with pytest.raises(LeaseNotFound):
        await pool.heartbeat(lease.lease_id)
    assert sample(pool, "clawrl_environments_leases_closed_total", reason="expired") == 1
    assert sample(pool, "clawrl_environments_leases_active") == 0


async def test_a_lease_past_its_ttl_is_gone_even_before_the_reaper_runs(pool: LeasePool) -> None:
    lease, _ = await pool.allocate("t", None)
    pool.clock.now += TTL + 1  # type: ignore[attr-defined]
    with pytest.raises(LeaseNotFound, match="expired"):
        await pool.exec_tool(lease.lease_id, "shell_exec", {"command": "true"})


async def test_a_busy_lease_does_not_expire_under_its_command(pool: LeasePool) -> None:
    lease, _ = await pool.allocate("t", None)
    await pool.reset(lease.lease_id, TaskMeta())
    running = asyncio.create_task(
        pool.exec_tool(lease.lease_id, "shell_exec", {"command": "sleep 1; echo done"})
    )
    await asyncio.sleep(0.3)
    pool.clock.now += TTL * 5  # type: ignore[attr-defined]
    assert await pool.reap_expired() == 0
    observation, result = await running
    assert observation == "done\n" and result is not None
    assert await pool.reap_expired() == 0  # renewed when its command ended
    pool.clock.now += TTL + 1  # type: ignore[attr-defined]
    assert await pool.reap_expired() == 1


async def test_a_full_pool_makes_room_from_expired_leases(pool: LeasePool) -> None:
    first, _ = await pool.allocate("a", None)
    await pool.allocate("b", None)
    with pytest.raises(PoolExhausted):
        await pool.allocate("c", None)
    pool.clock.now += TTL + 1  # type: ignore[attr-defined]
    third, _ = await pool.allocate("c", None)
    assert third.lease_id != first.lease_id
    assert sample(pool, "clawrl_environments_allocations_total", outcome="pool_exhausted") == 1


async def test_a_repeated_request_id_reuses_until_it_is_forgotten(pool: LeasePool) -> None:
    first, _ = await pool.allocate("a", "r1")
    again, reused = await pool.allocate("a", "r1")
    assert reused and again is first
    await pool.close(first.lease_id)
    fresh, reused = await pool.allocate("a", "r1")  # its lease is gone: a new one
    assert not reused and fresh.lease_id != first.lease_id


async def test_a_refused_reset_leaves_the_lease_without_a_sandbox(pool: LeasePool) -> None:
    lease, _ = await pool.allocate("t", None)
    await pool.reset(lease.lease_id, TaskMeta(files={"a": "1"}))
    with pytest.raises(BadTask, match="setup failed"):
        await pool.reset(lease.lease_id, TaskMeta(setup="echo broken >&2; exit 4"))
    assert not sandbox_dir(pool, lease.lease_id).exists()
    with pytest.raises(NotReset):
        await pool.exec_tool(lease.lease_id, "shell_exec", {"command": "ls"})
    with pytest.raises(BadTask, match="no-such-tool"):
        await pool.reset(lease.lease_id, TaskMeta(tools=["no-such-tool"]))
    assert sample(pool, "clawrl_environments_resets_total", outcome="bad_task") == 2


async def test_closing_a_lease_stops_its_running_command(pool: LeasePool) -> None:
    lease, _ = await pool.allocate("t", None)
    await pool.reset(lease.lease_id, TaskMeta())
    running = asyncio.create_task(
        pool.exec_tool(lease.lease_id, "shell_exec", {"command": "sleep 30"})
    )
    await asyncio.sleep(0.3)
    assert await pool.close(lease.lease_id)
    with pytest.raises(LeaseNotFound, match="closed while it ran"):
        await asyncio.wait_for(running, 10)
    assert not sandbox_dir(pool, lease.lease_id).exists()


async def test_evaluate_needs_a_checker(pool: LeasePool) -> None:
    lease, _ = await pool.allocate("t", None)
    await pool.reset(lease.lease_id, TaskMeta())
    with pytest.raises(LeaseError, match="no checker"):
        await pool.evaluate(lease.lease_id)
    verdict = await pool.evaluate(lease.lease_id, checker="test -d /workspace")
    assert verdict.passed and verdict.score == 1.0
