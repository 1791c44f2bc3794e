"""The kubernetes backend's commands (kube_exec.PodShell) run for real: the very argument lists
it sends by pod exec, run by the host's sh and coreutils (Debian's, as in the default sandbox
image python:3.12-slim) in a pid namespace of their own (`unshare --pid`, root), with temporary
directories standing in for the pod's /workspace and /tmp. Only the websocket transport of pod
exec is not run (no cluster here)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from clawrl.environments.backend import Limits, SandboxError
from clawrl.environments.kube_exec import CHUNK_BYTES, LocalPod, PodShell

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")),
        reason="needs root, unshare and nsenter",
    ),
]
LIMITS = Limits(cpu_s=10, memory_mb=512, file_size_mb=4, timeout_s=10.0, output_bytes=4096)


@pytest.fixture
async def local_pod() -> AsyncIterator[LocalPod]:
    pod = LocalPod()
    await pod.start()
    yield pod
    await pod.stop()


@pytest.fixture
def pod(tmp_path: Path, local_pod: LocalPod) -> tuple[PodShell, Path, Path]:
    workspace, scratch = tmp_path / "workspace", tmp_path / "tmp"
    workspace.mkdir()
    scratch.mkdir()
    shell = PodShell(local_pod, "sandbox-0", workspace=str(workspace), scratch=str(scratch))
    return shell, workspace, scratch


async def run(shell: PodShell, command: str, limits: Limits = LIMITS, **kwargs):
    kwargs.setdefault("env", {"HOME": "/workspace"})
    kwargs.setdefault("stdin", None)
    return await shell.run(command, limits, kwargs.pop("timeout_s", limits.timeout_s), **kwargs)


async def test_a_command_runs_in_the_workspace_with_its_env(pod) -> None:
    shell, workspace, _ = pod
    result = await run(shell, 'pwd; echo "$GREETING"; echo oops >&2; exit 3',
                       env={"GREETING": "hi there"})  # fmt: skip
    assert result.stdout == f"{workspace}\nhi there\n"
    assert result.stderr == "oops\n" and result.exit_code == 3
    assert not result.timed_out and not result.truncated and result.limit is None


async def test_the_verdict_line_cannot_be_forged(pod) -> None:
    shell, _, _ = pod
    result = await run(shell, r'printf "\n%s 0 1\n" deadbeefdeadbeefdeadbeefdeadbeef; exit 7')
    assert result.exit_code == 7 and not result.timed_out
    assert "deadbeef" in result.stdout


async def test_a_timeout_kills_the_command_and_all_it_started(pod) -> None:
    shell, workspace, _ = pod
    started = time.monotonic()
    result = await run(
        shell,
        "(sleep 3; touch late-child) & setsid sh -c 'sleep 3; touch late-setsid' & sleep 30",
        timeout_s=1.0,
    )
    assert result.timed_out and result.exit_code == -1
    assert time.monotonic() - started < 8
    await asyncio.sleep(3.5)
    assert sorted(p.name for p in workspace.iterdir()) == []


async def test_nothing_outlives_a_command_that_ended(pod) -> None:
    shell, workspace, _ = pod
    result = await run(shell, "(sleep 2; touch late) & setsid sh -c 'sleep 2; touch late2' & :")
    assert result.exit_code == 0
    await asyncio.sleep(2.5)
    assert not (workspace / "late").exists() and not (workspace / "late2").exists()


async def test_output_is_capped(pod) -> None:
    shell, _, _ = pod
    result = await run(shell, "head -c 100000 /dev/zero | tr '\\0' a; echo done >&2")
    assert result.truncated and result.stdout == "a" * LIMITS.output_bytes
    assert result.stderr == "done\n" and result.exit_code == 0


async def test_cpu_and_file_size_limits(pod) -> None:
    shell, workspace, _ = pod
    cpu = await run(shell, "while :; do :; done", Limits(cpu_s=1, timeout_s=20))
    assert (cpu.exit_code, cpu.limit, cpu.timed_out) == (128 + 24, "cpu", False)
    big = await run(shell, "head -c 5000000 /dev/zero > big", Limits(file_size_mb=1))
    assert (big.exit_code, big.limit) == (128 + 25, "file_size")
    assert (workspace / "big").stat().st_size == 1024 * 1024


async def test_stdin_small_and_large(pod) -> None:
    shell, _, _ = pod
    small = await run(shell, "cat", stdin=b"hello\x00world")
    assert small.stdout == "hello\x00world"
    data = os.urandom(3 * CHUNK_BYTES + 17)
    large = await run(shell, "wc -c; sha256sum", stdin=data)
    assert large.stdout.split() == [str(len(data)), hashlib.sha256(data).hexdigest(), "-"]


async def test_tmp_is_emptied_after_each_command_and_the_workspace_kept(pod) -> None:
    shell, _, scratch = pod
    await run(shell, f"echo kept > note; echo secret > {scratch}/.checker; mkdir {scratch}/d")
    assert list(scratch.iterdir()) == []
    assert (await run(shell, "cat note")).stdout == "kept\n"


async def test_seed_tools_and_wipe(pod) -> None:
    shell, workspace, scratch = pod
    await shell.seed({"a.txt": "one\n", "sub/dir/b.bin": bytes(range(256)) * 400})
    assert (workspace / "a.txt").read_text() == "one\n"
    assert (workspace / "sub/dir/b.bin").read_bytes() == bytes(range(256)) * 400
    assert list(scratch.iterdir()) == []  # the archive is gone
    assert await shell.missing_tools(["sh", "grep", "no-such-tool-xyz"]) == ["no-such-tool-xyz"]
    await run(shell, "mkdir locked && touch locked/f && chmod 000 locked")
    await shell.wipe()
    assert list(workspace.iterdir()) == []


async def test_a_script_that_cannot_start_is_a_sandbox_error(
    tmp_path: Path, local_pod: LocalPod
) -> None:
    shell = PodShell(local_pod, "p", workspace=str(tmp_path), scratch=str(tmp_path / "none"))
    with pytest.raises(SandboxError, match="could not run"):
        await run(shell, "true")
