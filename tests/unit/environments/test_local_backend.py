"""The local backend's last lines of defence, with real bubblewrap sandboxes: a sandbox whose
service is gone still ends at its own backstop timeout, and a restarted service kills the
processes of a leftover sandbox, found by the workspace its bwrap binds."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator

import pytest

from clawrl.environments.backend import Limits, SandboxHandle, SandboxSpec
from clawrl.environments.local import LocalBackend
from clawrl.environments.settings import LocalSandboxSettings
from tests.sandbox_service import processes_with, sandbox_root, unique_marker, wait_no_processes


@pytest.fixture
async def backends() -> AsyncIterator[tuple[LocalBackend, LocalBackend]]:
    """Two backends over one root: the first stands for a dead service, the second for its
    successor."""
    root = sandbox_root()
    first = LocalBackend(LocalSandboxSettings(root_dir=root))
    second = LocalBackend(LocalSandboxSettings(root_dir=root))
    await first.probe()
    await second.probe()
    yield first, second
    await first.aclose()
    await second.aclose()
    shutil.rmtree(root, ignore_errors=True)


async def test_the_sandboxs_own_timeout_is_a_backstop(
    backends: tuple[LocalBackend, LocalBackend],
) -> None:
    backend, _ = backends
    handle = await backend.create("backstop", SandboxSpec(limits=Limits(timeout_s=60)))
    marker = unique_marker()
    # The service's timer is set far off: only the sandbox's timeout (1 s) can end this.
    argv = backend.command_argv(
        backend.root / handle.id, SandboxSpec(), f"sleep 1{marker} & sleep 2{marker}", (), 1.0
    )
    started = time.monotonic()
    run = await backend._run(handle.id, argv, None, 30, 1000)
    assert not run.timed_out and run.returncode == 128 + 9
    assert time.monotonic() - started < 10
    assert wait_no_processes(marker) == []


async def test_a_successor_kills_a_leftover_sandboxs_processes(
    backends: tuple[LocalBackend, LocalBackend],
) -> None:
    dead, successor = backends
    handle = await dead.create("leftover", SandboxSpec(files={"f": "1"}))
    marker = unique_marker()
    running = asyncio.create_task(dead.exec(handle, f"sleep 3{marker}", timeout_s=120))
    for _ in range(100):
        if processes_with(marker):
            break
        await asyncio.sleep(0.05)
    assert processes_with(marker)
    (listed,) = await successor.list_live()
    assert listed.id == handle.id
    await successor.destroy(SandboxHandle(listed.id, listed.backend, listed.data))
    assert wait_no_processes(marker) == []
    assert not (successor.root / handle.id).exists()
    result = await asyncio.wait_for(running, 10)  # the first one's command was killed under it
    assert result.exit_code == 128 + 9 and not result.timed_out
