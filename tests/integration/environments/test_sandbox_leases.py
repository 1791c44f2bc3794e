"""The lease lifecycle over real HTTP against a real `clawrl-environments` (local bubblewrap
backend): TTL expiry reclaims a crashed runner's sandbox, heartbeats keep a lease, reset gives a
fresh workspace, close removes it, a full pool answers 429, bad requests get clear errors, the
bearer token is enforced, a killed service's leftovers are removed at its next start, and a host
that cannot isolate is refused."""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from clawrl.environments.client import (
    Lease,
    LeaseNotFound,
    PoolExhausted,
    SandboxClient,
    SandboxServiceError,
)
from tests.conftest import VENV_BIN, ChildProcess, wait_until
from tests.sandbox_service import (
    SandboxService,
    processes_with,
    sandbox_root,
    sandbox_service,
    unique_marker,
    wait_no_processes,
)

pytestmark = pytest.mark.integration

TOKEN = "test-token-" + uuid.uuid4().hex
TTL_S = 2.0
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def service(log_dir: Path) -> Iterator[SandboxService]:
    with sandbox_service(
        log_dir,
        name="environments-leases",
        CLAWRL_ENVIRONMENTS_SERVER__TOKEN=TOKEN,
        CLAWRL_LEASES__MAX_LEASES="3",
        CLAWRL_LEASES__TTL_S=str(TTL_S),
        CLAWRL_LEASES__REAP_INTERVAL_S="0.2",
        CLAWRL_SANDBOX_MAX_LIMITS__TIMEOUT_S="30",
    ) as running:
        yield running


@pytest.fixture
async def client(service: SandboxService) -> AsyncIterator[SandboxClient]:
    async with SandboxClient(service.url, token=TOKEN) as c:
        yield c
    # Every test leaves the pool empty for the next one.
    async with httpx.AsyncClient(base_url=service.url, headers=AUTH) as http:
        for lease in (await http.get("/status")).json()["pool"]["leases"]:
            await http.post("/close", json={"lease_id": lease["lease_id"]})


@pytest.fixture
async def raw(service: SandboxService) -> AsyncIterator[httpx.AsyncClient]:
    """Plain HTTP with the token, for what the client would not send."""
    async with httpx.AsyncClient(base_url=service.url, headers=AUTH) as http:
        yield http


async def eventually(check: Callable[[], bool], timeout_s: float) -> bool:
    """Whether check() turns true within timeout_s (polled every 50 ms)."""
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return True
        await asyncio.sleep(0.05)
    return check()


def workspace(service: SandboxService, lease_id: str) -> Path:
    return service.root / lease_id / "workspace"


async def reset(client: SandboxClient, files: dict[str, str] | None = None) -> Lease:
    lease = Lease(client, await client.allocate("lifecycle"))
    await lease.reset({"task_name": "lifecycle", "files": files or {}})
    return lease


async def test_a_lease_nobody_renews_is_reclaimed(
    service: SandboxService, client: SandboxClient
) -> None:
    """A runner that dies mid-command: its command ends at its timeout, then the TTL passes and
    the sandbox goes (workspace removed, no process left)."""
    marker = f"4{unique_marker()}"
    expired_before = service.metric("clawrl_environments_leases_closed_total", reason="expired")
    lease = await reset(client, {"work.txt": "unsaved\n"})
    assert workspace(service, lease.lease_id).is_dir()
    runner = asyncio.create_task(
        lease.exec_tool("shell_exec", {"command": f"sleep {marker}", "timeout": 3})
    )
    assert await eventually(lambda: bool(processes_with(marker)), 5)
    runner.cancel()  # the runner is gone: nobody waits for the answer or heartbeats
    # Busy, it outlives its TTL; then the command's timeout (3 s) and the TTL (2 s) pass.
    await asyncio.sleep(TTL_S + 0.5)
    assert workspace(service, lease.lease_id).is_dir()
    gone = await eventually(lambda: not (service.root / lease.lease_id).exists(), 3 + TTL_S + 3)
    assert gone
    assert wait_no_processes(marker) == []
    with pytest.raises(LeaseNotFound):
        await client.heartbeat(lease.lease_id)
    after = service.metric("clawrl_environments_leases_closed_total", reason="expired")
    assert after == expired_before + 1


async def test_heartbeats_keep_a_lease(service: SandboxService, client: SandboxClient) -> None:
    lease = await reset(client, {"kept.txt": "kept\n"})
    for _ in range(int(TTL_S * 2 / 0.5)):  # twice the TTL, renewed every 0.5 s
        await asyncio.sleep(0.5)
        assert 0 < await client.heartbeat(lease.lease_id) <= TTL_S
    tool = await lease.exec_tool("shell_exec", {"command": "cat kept.txt"})
    assert tool.observation == "kept\n"
    await asyncio.sleep(TTL_S + 1)  # no more heartbeats: it expires
    assert not (service.root / lease.lease_id).exists()
    with pytest.raises(LeaseNotFound):
        await lease.exec_tool("shell_exec", {"command": "true"})


async def test_reset_gives_a_fresh_workspace(
    service: SandboxService, client: SandboxClient
) -> None:
    lease = await reset(client, {"a.txt": "first\n"})
    await lease.exec_tool("shell_exec", {"command": "echo junk > junk.txt && mkdir -p d/e"})
    out = await lease.reset({"task_name": "second", "instruction": "do b", "files": {"b.txt": "2"}})
    assert out.user_msg == "Task name: second\nTask instruction: do b"
    assert [t["function"]["name"] for t in out.tool_schemas] == [
        "shell_exec",
        "shell_write_content_to_file",
    ]
    listing = await lease.exec_tool("shell_exec", {"command": "ls -A"})
    assert listing.observation == "b.txt\n"
    assert sorted(p.name for p in workspace(service, lease.lease_id).iterdir()) == ["b.txt"]
    await client.close(lease.lease_id)


async def test_close_removes_the_sandbox(service: SandboxService, client: SandboxClient) -> None:
    lease = await reset(client, {"a.txt": "x"})
    # A directory the agent made unreadable still goes.
    await lease.exec_tool("shell_exec", {"command": "mkdir -p locked/in && touch locked/in/f"})
    await lease.exec_tool("shell_exec", {"command": "chmod 000 locked/in locked"})
    assert await client.close(lease.lease_id) is True
    assert not (service.root / lease.lease_id).exists()
    assert await client.close(lease.lease_id) is False
    with pytest.raises(LeaseNotFound) as err:
        await lease.exec_tool("shell_exec", {"command": "true"})
    assert err.value.status == 404 and err.value.code == "LEASE_NOT_FOUND"


async def test_a_full_pool_answers_429(
    service: SandboxService, client: SandboxClient, raw: httpx.AsyncClient
) -> None:
    held = [await client.allocate(f"task-{i}") for i in range(3)]
    response = await raw.post("/allocate", json={"task_key": "one-more"})
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "5"
    assert response.json()["ok"] is False and response.json()["code"] == "POOL_EXHAUSTED"
    with pytest.raises(PoolExhausted):
        await client.allocate("one-more")
    await client.close(held[0])
    assert (await client.allocate("one-more")).startswith("lease-")
    assert service.metric("clawrl_environments_allocations_total", outcome="pool_exhausted") >= 2
    assert service.metric("clawrl_environments_leases_active") == 3


async def test_a_repeated_request_id_gets_the_same_lease(client: SandboxClient) -> None:
    first = await client.allocate("task", request_id="req-1")
    assert await client.allocate("task", request_id="req-1") == first
    assert await client.allocate("task", request_id="req-2") != first


async def test_tool_calls_and_checkers(client: SandboxClient) -> None:
    lease = Lease(client, await client.allocate("checker"))
    await lease.reset(
        {
            "task_name": "answer",
            "files": {"q.txt": "6*7\n"},
            "checker": 'test "$(cat answer.txt)" = 42',
            "checker_tools": ["python3"],
        }
    )
    assert not (await lease.evaluate()).passed
    # OpenAI's form: arguments as a JSON string.
    body = {"file_path": "answer.txt", "content": "42\n"}
    wrote = await lease.exec_tool("shell_write_content_to_file", json.dumps(body))  # type: ignore[arg-type]
    assert wrote.result is not None and wrote.result.exit_code == 0
    verdict = await lease.evaluate()
    assert verdict.passed and verdict.score == 1.0 and verdict.exit_code == 0
    # A checker with its own interpreter (checker_tools), given at /evaluate.
    script = (
        "#!/usr/bin/python3\nimport sys\n"
        "sys.exit(0 if open('answer.txt').read() == '42\\n' else 3)\n"
    )
    assert (await lease.evaluate(checker=script)).passed
    failing = await lease.evaluate(checker="echo wrong >&2; exit 3")
    assert not failing.passed and failing.exit_code == 3 and "wrong" in failing.output
    # The agent's python3 is not on its PATH (only the checker's).
    missing = await lease.exec_tool("shell_exec", {"command": "python3 -c 1"})
    assert "not found" in missing.observation
    invalid = await lease.exec_tool("rm_rf", {})
    assert invalid.result is None and invalid.observation.startswith("[TOOL_ERROR] rm_rf:")
    outside = await lease.exec_tool(
        "shell_write_content_to_file", {"file_path": "../../etc/x", "content": "x"}
    )
    assert outside.result is None and "outside /workspace" in outside.observation


async def post(
    http: httpx.AsyncClient, path: str, body: object, headers: dict[str, str] | None = None
) -> httpx.Response:
    if isinstance(body, bytes):
        return await http.post(path, content=body, headers=headers)
    return await http.post(path, json=body, headers=headers)


async def test_bad_requests_get_clear_errors(
    service: SandboxService, client: SandboxClient, raw: httpx.AsyncClient
) -> None:
    lease_id = await client.allocate("bad")
    cases = [
        ("/allocate", b"{not json", 400, "BAD_REQUEST", "not JSON"),
        ("/allocate", [1, 2], 400, "BAD_REQUEST", "JSON object"),
        ("/allocate", {}, 400, "BAD_REQUEST", "task_key"),
        ("/heartbeat", {"lease_id": "lease-nope"}, 404, "LEASE_NOT_FOUND", "lease-nope"),
        ("/reset", {"lease_id": lease_id}, 400, "BAD_REQUEST", "task_meta"),
        (
            "/exec_tool",
            {
                "lease_id": lease_id,
                "tool_call": {"name": "shell_exec", "arguments": {"command": "ls"}},
            },
            409,
            "NOT_RESET",
            "/reset",
        ),
        ("/evaluate", {"lease_id": lease_id}, 409, "NOT_RESET", "/reset"),
        (
            "/reset",
            {"lease_id": lease_id, "task_meta": {"tools": ["no-such-tool"]}},
            400,
            "BAD_TASK",
            "no-such-tool",
        ),
        (
            "/reset",
            {"lease_id": lease_id, "task_meta": {"files": {"../x": "y"}}},
            400,
            "BAD_TASK",
            "inside the workspace",
        ),
        (
            "/reset",
            {"lease_id": lease_id, "task_meta": {"limits": {"timeout_s": 9999}}},
            400,
            "BAD_TASK",
            "timeout_s=9999",
        ),
        (
            "/reset",
            {"lease_id": lease_id, "task_meta": {"limits": {"pid": 3}}},
            400,
            "BAD_REQUEST",
            "task_meta.limits.pid",
        ),
        (
            "/reset",
            {"lease_id": lease_id, "task_meta": {"setup": "exit 7"}},
            400,
            "BAD_TASK",
            "setup failed",
        ),
        (
            "/exec_tool",
            {"lease_id": lease_id, "tool_call": {"arguments": {}}},
            400,
            "BAD_REQUEST",
            "tool_call.name",
        ),
        ("/allocate", b"x" * (4 * 1024 * 1024 + 1), 413, "TOO_LARGE", "bytes"),
    ]
    for path, body, status, code, words in cases:
        response = await post(raw, path, body)
        answer = response.json()
        assert (response.status_code, answer["code"]) == (status, code), (path, body, answer)
        assert answer["ok"] is False and words in answer["error"], (path, answer)
    await client.close(lease_id)
    assert (
        service.metric("clawrl_environments_request_errors_total", route="/reset", code="BAD_TASK")
        >= 4
    )
    # A reset refused for its task leaves no sandbox behind.
    assert not (service.root / lease_id).exists()


async def test_the_token_is_required(service: SandboxService) -> None:
    async with httpx.AsyncClient(base_url=service.url) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = await post(http, "/allocate", {"task_key": "t"}, headers=headers)
            assert response.status_code == 401 and response.json()["code"] == "UNAUTHORIZED"
            assert (await http.get("/status", headers=headers)).status_code == 401
        assert (await http.get("/health")).json()["ok"] is True
        assert "clawrl_environments_leases_active" in (await http.get("/metrics")).text
    with pytest.raises(SandboxServiceError) as err:
        async with SandboxClient(service.url) as anonymous:
            await anonymous.allocate("t")
    assert err.value.status == 401


def test_a_killed_service_leaves_nothing_running_and_its_restart_cleans_up(
    log_dir: Path,
) -> None:
    root = sandbox_root()
    marker = f"4{unique_marker()}"
    first = SandboxService(log_dir, root, name="environments-killed")
    headers = {"Content-Type": "application/json"}
    lease = httpx.post(f"{first.url}/allocate", json={"task_key": "k"}, headers=headers).json()
    lid = lease["lease_id"]
    httpx.post(f"{first.url}/reset", json={"lease_id": lid, "task_meta": {"files": {"f": "1"}}})
    call = {
        "lease_id": lid,
        "tool_call": {"name": "shell_exec", "arguments": {"command": f"sleep {marker}"}},
    }
    with httpx.Client() as http:
        pending = http.build_request("POST", f"{first.url}/exec_tool", json=call)
        threading.Thread(target=lambda: _send_quietly(http, pending), daemon=True).start()
        wait_until(lambda: bool(processes_with(marker)), 10, "the sandboxed sleep")
        first.kill()
    # The sandbox usually dies with the service (bwrap's --die-with-parent); a kill while its
    # pid 1 arms that signal leaves the command running (seen once in ~20), and then the
    # restart kills it, as the sandbox's own timeout would 5 s past its limit.
    assert (root / lid / "workspace" / "f").is_file()  # nobody removed it: the service is dead
    second = SandboxService(log_dir, root, name="environments-restarted")
    try:
        assert wait_no_processes(marker) == []
        assert not (root / lid).exists()
        assert second.metric("clawrl_environments_leftover_sandboxes_removed_total") == 1
    finally:
        second.stop()
        first.stop()
        shutil.rmtree(root, ignore_errors=True)


def _send_quietly(http: httpx.Client, request: httpx.Request) -> None:
    try:
        http.send(request)
    except httpx.HTTPError:
        pass  # the service was killed under it


def test_a_host_that_cannot_isolate_is_refused(log_dir: Path) -> None:
    """bwrap failing the way it does without user namespaces: the service exits at start."""
    bin_dir = Path(tempfile.mkdtemp(prefix="clawrl-fake-bwrap-"))
    bin_dir.chmod(0o755)  # the sandbox uid must reach it, as it would the real one
    fake = bin_dir / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to create a new namespace, likely because the "
        "kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    root = sandbox_root()
    env = {
        "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
        "CLAWRL_SANDBOX__ROOT_DIR": str(root),
        "CLAWRL_SANDBOX__BWRAP_PATH": str(fake),
        "CLAWRL_ENVIRONMENTS_SERVER__PORT": "1",  # never bound: the start fails before
    }
    child = ChildProcess(
        "environments-refused", [str(VENV_BIN / "clawrl-environments")], log_dir, env
    )
    try:
        assert child.proc.wait(timeout=30) != 0
        log = child.log_path.read_text()
        assert "refusing to start" in log and "user namespaces" in log, log[-2000:]
        assert not any(root.iterdir())  # the probe's sandbox was removed too
    finally:
        child.stop()
        shutil.rmtree(root)
        shutil.rmtree(bin_dir)
