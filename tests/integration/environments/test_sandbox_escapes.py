"""Escapes from a local sandbox fail and lose nothing: a real `clawrl-environments` over real
HTTP, real bubblewrap sandboxes, the real Redis of the session and a real HTTP server on the
host. Each attempt is first shown to work from the host itself (so the test can fail), then
made from inside a sandbox; afterwards the service is up, the other lease still works and the
host is as it was."""

from __future__ import annotations

import http.server
import shlex
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis

from clawrl.environments.client import Lease, SandboxClient
from tests.conftest import free_port
from tests.sandbox_service import (
    SandboxService,
    processes_with,
    sandbox_service,
    unique_marker,
    wait_no_processes,
)

pytestmark = pytest.mark.integration


def connect_script(ports: list[int]) -> str:
    """Python that tries a TCP connection to each port of 127.0.0.1 and says what happened."""
    return (
        "import socket\n"
        f"for port in {ports!r}:\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=2).close()\n"
        "        print('CONNECTED', port)\n"
        "    except OSError as exc:\n"
        "        print('refused', port, exc)\n"
    )


def host_file(path: str) -> bytes | None:
    """A host file's bytes, None when it does not exist."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def bash_redis_ping(port: int) -> str:
    """A PING in Redis's protocol over bash's /dev/tcp, without python."""
    return f"exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'PING\\r\\n' >&3 && head -c 5 <&3"


@pytest.fixture(scope="module")
def service(log_dir: Path) -> Iterator[SandboxService]:
    with sandbox_service(
        log_dir,
        name="environments-escapes",
        CLAWRL_LEASES__MAX_LEASES="4",
        CLAWRL_SANDBOX_LIMITS__PIDS="32",
        CLAWRL_SANDBOX_LIMITS__MEMORY_MB="512",
        CLAWRL_SANDBOX_LIMITS__TIMEOUT_S="20",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def host_http() -> Iterator[int]:
    """A real HTTP server on the host's loopback."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"HOST-PAGE")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture
async def client(service: SandboxService) -> AsyncIterator[SandboxClient]:
    async with SandboxClient(service.url) as c:
        yield c


async def fresh(client: SandboxClient, name: str, **meta: object) -> Lease:
    lease = Lease(client, await client.allocate(name))
    await lease.reset({"task_name": name, "tools": ["python3"], **meta})
    return lease


async def shell(lease: Lease, command: str, **arguments: object) -> str:
    return (await lease.exec_tool("shell_exec", {"command": command, **arguments})).observation


@pytest.fixture
async def bystander(client: SandboxClient) -> AsyncIterator[Lease]:
    """Another lease with a file in its workspace: it must come through every escape intact."""
    lease = await fresh(client, "bystander", files={"mine.txt": "BYSTANDER-DATA\n"})
    yield lease
    await client.close(lease.lease_id)


async def assert_nothing_lost(service: SandboxService, bystander: Lease) -> None:
    assert service.alive() and service.healthy()
    assert await shell(bystander, "cat mine.txt") == "BYSTANDER-DATA\n"


async def test_host_ports_are_unreachable(
    service: SandboxService, client: SandboxClient, bystander: Lease, redis_url: str, host_http: int
) -> None:
    redis_port = urlparse(redis_url).port
    assert redis_port is not None
    host = redis.Redis.from_url(redis_url)
    host.set("escape-test", "intact")
    ports = [redis_port, host_http]
    # The same attempts from the host succeed: what fails inside fails because of the sandbox.
    run = lambda *argv: subprocess.run(argv, capture_output=True, text=True, check=False).stdout  # noqa: E731
    assert run("python3", "-c", connect_script(ports)).count("CONNECTED") == 2
    assert run("bash", "-c", bash_redis_ping(redis_port)) == "+PONG"

    lease = await fresh(client, "net")
    inside = await shell(lease, f"python3 -c {shlex.quote(connect_script(ports))}")
    assert [line.split()[0] for line in inside.splitlines()] == ["refused", "refused"], inside
    assert "PONG" not in await shell(lease, f"bash -c {shlex.quote(bash_redis_ping(redis_port))}")
    fetch = f"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{host_http}').read())"
    assert "HOST-PAGE" not in await shell(lease, f"python3 -c {shlex.quote(fetch)}")
    # Only the sandbox's own loopback exists: no interface leads out.
    interfaces = await shell(lease, "cat /proc/net/dev")
    assert [line.split(":")[0].strip() for line in interfaces.splitlines() if ":" in line] == ["lo"]
    assert host.get("escape-test") == b"intact"
    await client.close(lease.lease_id)
    await assert_nothing_lost(service, bystander)


async def test_files_outside_the_workspace_cannot_be_read(
    service: SandboxService, client: SandboxClient, bystander: Lease
) -> None:
    secret = Path("/tmp") / f"clawrl-secret-{uuid.uuid4().hex}"
    secret.write_text("HOST-SECRET\n")
    secret.chmod(0o644)  # readable by anyone on the host: only the sandbox's view protects it
    try:
        lease = await fresh(client, "read")
        tries = [
            f"cat {secret}",
            f"python3 -c \"print(open('{secret}').read())\"",
            "cat /etc/shadow /root/.bash_history /proc/1/environ",
            f"ls -la {service.root} /tmp /home /root /work",
            f"cat {service.root}/{bystander.lease_id}/workspace/mine.txt",
            "find / -name mine.txt -o -name 'clawrl-secret-*' 2>/dev/null",
        ]
        for command in tries:
            out = await shell(lease, command)
            assert "HOST-SECRET" not in out and "BYSTANDER-DATA" not in out, (command, out)
            if command.startswith(("ls", "find")):  # listings: not even the name is seen
                assert bystander.lease_id not in out, (command, out)
        # What the sandbox can see of the host's binaries: only its tools.
        assert "redis-server" not in await shell(lease, "ls /usr/bin /bin /usr/local/bin")
        assert "not found" in await shell(lease, "redis-cli ping")
        await client.close(lease.lease_id)
    finally:
        secret.unlink()
    await assert_nothing_lost(service, bystander)


async def test_nothing_outside_the_workspace_can_be_written(
    service: SandboxService, client: SandboxClient, bystander: Lease
) -> None:
    name = f"clawrl-pwned-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, Path("/var/tmp") / name, Path("/usr/bin") / name]
    lease = await fresh(client, "write")
    tries = [
        f"echo x > /var/tmp/{name}",
        f"echo x > /usr/bin/{name}",
        "echo x > /etc/passwd",
        f"echo x > /{name}",
        "ln -s /etc/hosts /workspace/link && echo x >> /workspace/link",
    ]
    hosts = host_file("/etc/hosts")
    for command in tries:
        out = await shell(lease, command)
        assert "[exit code" in out, (command, out)
    # /tmp inside is the command's own tmpfs: writing there works and never reaches the host,
    # not even at the path of the other lease's workspace (the service's root is under /tmp).
    assert await shell(lease, f"echo x > /tmp/{name} && cat /tmp/{name}") == "x\n"
    other = f"{service.root}/{bystander.lease_id}/workspace"
    await shell(lease, f"mkdir -p {other} && echo x > {other}/mine.txt")
    assert [host_file(str(t)) for t in targets] == [None, None, None]
    assert host_file("/etc/hosts") == hosts
    # Inside, the writable places are the workspace and a private /tmp, nothing else.
    ok = await shell(lease, "echo x > /workspace/here && echo x > /tmp/there && echo both")
    assert ok.strip() == "both"
    assert (service.root / lease.lease_id / "workspace" / "here").read_text() == "x\n"
    await client.close(lease.lease_id)
    await assert_nothing_lost(service, bystander)


async def test_a_fork_bomb_is_bounded(
    service: SandboxService, client: SandboxClient, bystander: Lease
) -> None:
    marker = f"bomb{unique_marker()}"
    lease = await fresh(client, "bomb")
    started = time.monotonic()
    # The main shell forks once, for the bomb, then only runs builtins (a counting loop): dash
    # gives up on a script whose own fork fails, and the bomb must have time to hit the limit.
    command = (
        f": {marker}; b(){{ b | b & }}; (b) & "
        "i=0; while [ $i -lt 200000 ]; do i=$((i + 1)); done; echo survived"
    )
    result = (await lease.exec_tool("shell_exec", {"command": command})).result
    assert result is not None
    assert result.limit == "pids" and "survived" in result.stdout, result
    assert time.monotonic() - started < 20  # ended by itself, not by the timeout
    assert service.metric("clawrl_environments_limit_hits_total", limit="pids") >= 1
    # The bomb's processes died with its sandbox; the lease itself still works.
    assert wait_no_processes(marker) == []
    assert await shell(lease, "echo after") == "after\n"
    await client.close(lease.lease_id)
    await assert_nothing_lost(service, bystander)


async def test_a_command_past_its_timeout_is_killed_with_its_children(
    service: SandboxService, client: SandboxClient, bystander: Lease
) -> None:
    marker = unique_marker()
    lease = await fresh(client, "timeout")
    command = (
        f"sleep 1{marker} & (setsid sleep 2{marker} &); nohup sleep 3{marker} >/dev/null 2>&1 & "
        f"python3 -c 'import os, time; os.fork() or os.setsid(); time.sleep(4{marker})' & "
        f"sleep 5{marker}"
    )
    started = time.monotonic()
    tool = await lease.exec_tool("shell_exec", {"command": command, "timeout": 2})
    took = time.monotonic() - started
    assert tool.result is not None and tool.result.timed_out and tool.result.exit_code == -1
    assert "[killed: timed out" in tool.observation
    assert 2 <= took < 10, took
    assert wait_no_processes(marker) == [], processes_with(marker)
    assert service.metric("clawrl_environments_limit_hits_total", limit="timeout") >= 1
    # A checker that hangs is killed the same way, and fails.
    verdict = await lease.evaluate(checker=f"sleep 6{marker}", timeout_s=1)
    assert not verdict.passed and verdict.timed_out and verdict.score == 0.0
    assert wait_no_processes(marker) == []
    await client.close(lease.lease_id)
    await assert_nothing_lost(service, bystander)


async def test_memory_and_output_limits(
    service: SandboxService, client: SandboxClient, bystander: Lease
) -> None:
    lease = await fresh(client, "limits", limits={"memory_mb": 256, "output_bytes": 1000})
    out = await shell(lease, "python3 -c 'x = bytearray(1024 ** 3); print(len(x))'")
    assert "MemoryError" in out and "1073741824" not in out
    cut = (await lease.exec_tool("shell_exec", {"command": "seq 1 100000"})).result
    assert cut is not None and cut.truncated and len(cut.stdout) == 1000
    assert cut.stdout.startswith("1\n2\n3\n")
    await client.close(lease.lease_id)
    await assert_nothing_lost(service, bystander)
