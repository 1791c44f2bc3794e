"""`clawrl agent run` against the real stack: a real gateway in front of the CPU engine serving
SmolLM2-135M-Instruct (greedy: the tiny random model never writes a tool call), the session's
real Redis and the real sandbox service (local bubblewrap backend).

- One episode is recorded as turns whose next states are the sandbox's tool results, its last
  request says X-Session-Done when the step limit ends it, and the checker's outcome is posted
  for the session (stored where the judge reads it).
- Killing the runner mid-episode (inside the checker: a process runs in its sandbox) leaves no
  sandbox behind: SIGTERM closes the lease at once; after SIGKILL the service's TTL reclaims
  it. Either way the lease list ends empty and the sandbox's processes are gone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from clawrl.common.proto.records_pb2 import FinalizeReason
from tests.conftest import VENV_BIN, ChildProcess, free_port, wait_until
from tests.integration.gateway.helpers import GatewayHandle
from tests.sandbox_service import (
    SandboxService,
    processes_with,
    sandbox_service,
    wait_no_processes,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REAL = "SmolLM2-135M-Instruct"
PREFIX = f"agent{random.randrange(10**6)}"
TTL_S = 3.0
# The checker of the kill tests sleeps this long (a unique argument, to find its process).
SLEEP = f"8.{random.randrange(10**6):06d}"


@pytest.fixture(autouse=True)
def _no_config_file(monkeypatch) -> None:
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")


@pytest.fixture(scope="module")
def gateway(log_dir, redis_url, engine_factory) -> Iterator[GatewayHandle]:
    engine = engine_factory(REAL)
    port, grpc_port = free_port(), free_port()
    env = {
        "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
        "CLAWRL_MODEL__PATH": REAL,
        "CLAWRL_SESSIONS__KEY_PREFIX": f"{PREFIX}:gw",
        "CLAWRL_SESSIONS__SPOOL_DIR": str(log_dir / f"spool-{PREFIX}"),
        "CLAWRL_REDIS__TURNS_STREAM": f"{PREFIX}:turns",
        "CLAWRL_CONTROL__SERVED_KEY": f"{PREFIX}:serving",
        "CLAWRL_EPISODES__KEY_PREFIX": f"{PREFIX}:outcome",
    }
    argv = [str(VENV_BIN / "clawrl-gateway"), "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", str(grpc_port), "--engine-url", engine,
            "--redis-url", redis_url]  # fmt: skip
    child = ChildProcess("gateway-agent", argv, log_dir, env=env)
    handle = GatewayHandle("agent", f"http://127.0.0.1:{port}", grpc_port, f"{PREFIX}:turns",
                           redis_url, child)  # fmt: skip
    try:
        wait_until(lambda: httpx.get(f"{handle.url}/healthz", timeout=1).status_code == 200,
                   300, "gateway-agent", child.proc)  # fmt: skip
        yield handle
    finally:
        child.stop()


@pytest.fixture(scope="module")
def service(log_dir) -> Iterator[SandboxService]:
    with sandbox_service(
        log_dir,
        name="environments-runner",
        CLAWRL_LEASES__TTL_S=str(TTL_S),
        CLAWRL_LEASES__REAP_INTERVAL_S="0.25",
    ) as service:
        yield service


def family_file(directory: Path, family: str, tasks: list[dict], tools: list[str]) -> Path:
    """A task set of one family; a held-out twin of the first task keeps the loader happy."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f'family = "{family}"', "[defaults]", f"tools = {json.dumps(tools)}",
             "command_timeout_s = 5.0", "checker_timeout_s = 30.0"]  # fmt: skip
    held_out = {**tasks[0], "id": f"{family}.held", "split": "heldout"}
    for task in [*tasks, held_out]:
        lines.append("[[tasks]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in task.items()]
    (directory / f"{family}.toml").write_text("\n".join(lines) + "\n")
    return directory


def runner_argv(gateway: GatewayHandle, service: SandboxService, tasks: Path, out: Path,
                *extra: str) -> list[str]:  # fmt: skip
    return [str(VENV_BIN / "clawrl"), "agent", "run", "--gateway-url", gateway.base_url,
            "--environments-url", service.url, "--tasks-dir", str(tasks), "--out", str(out),
            "--heartbeat-s", "0.5", "--concurrency", "1", *extra]  # fmt: skip


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def leases(service: SandboxService) -> list[dict]:
    return httpx.get(f"{service.url}/status", timeout=5).json()["pool"]["leases"]


def test_an_episode_is_recorded_with_tool_results_as_next_states(
    gateway, service, tmp_path, redis_url
):
    # The step limit (1) ends it: the request after its command says X-Session-Done.
    tasks = mkdir_tasks(tmp_path / "tasks")
    out = tmp_path / "episodes.jsonl"
    done = subprocess.run(
        runner_argv(gateway, service, tasks, out, "--temperature", "0", "--transcripts"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    [episode] = lines_of(out)
    assert episode["task_id"] == "mkdir.limit" and episode["split"] == "train"
    assert (episode["steps"], episode["requests"], episode["ended"]) == (1, 2, "step_limit")
    assert (episode["passed"], episode["score"], episode["error"]) == (True, 1.0, "")
    assert (episode["policy_version"], episode["outcome"]) == (0, "accepted")
    call = episode["transcript"][1]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == (
        "shell_exec",
        {"command": "mkdir backup"},
    )

    # The turns: the tool call's next state is the sandbox's result, as a tool message.
    session = episode["session_id"]
    turns = gateway.wait_turns(session, 2)
    assert [t.turn_index for t in turns] == [0, 1]
    first, last = turns
    assert first.finish_reason == "tool_calls" and first.episode
    assert json.loads(first.response_message_json)["tool_calls"][0]["function"]["name"] == (
        "shell_exec"
    )
    next_state = json.loads(first.next_state_json)
    assert next_state["role"] == "tool" and next_state["content"] == "[no output]"
    assert (
        next_state["tool_call_id"] == json.loads(first.response_message_json)["tool_calls"][0]["id"]
    )
    assert first.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert last.finalize_reason == FinalizeReason.FINALIZE_REASON_SESSION_DONE
    assert last.episode and not last.next_state_json

    # The checker's verdict, stored for the session where the judge looks for it.
    store = redis.Redis.from_url(redis_url)
    [key] = store.keys(f"{PREFIX}:outcome:{session}:*")
    stored = orjson.loads(store.hget(key, "state"))
    assert (stored["outcome"], stored["task_id"]) == (1.0, "mkdir.limit")
    assert leases(service) == []


def slow_checker_tasks(directory: Path) -> Path:
    """A task whose checker runs for SLEEP seconds (and fails): the runner is mid-episode, a
    process in its sandbox, for that long."""
    return family_file(directory, "slow", [
        {"id": "slow.checker", "split": "train", "max_steps": 1, "instruction": "Say hello.",
         "solution": "true", "checker": f"sleep {SLEEP}; exit 1"},
    ], ["sh", "sleep"])  # fmt: skip


def start_runner_in_checker(gateway, service, tmp_path) -> subprocess.Popen:
    """A runner (plain prompt: no tool call, so the checker runs after one short reply), once
    its checker runs in the sandbox."""
    argv = runner_argv(gateway, service, slow_checker_tasks(tmp_path / "tasks"),
                       tmp_path / "episodes.jsonl", "--prompt", "plain", "--max-tokens", "8",
                       "--no-outcome")  # fmt: skip
    log = (tmp_path / "runner.log").open("wb")
    runner = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    wait_until(lambda: bool(processes_with(f"sleep {SLEEP}")), 120, "the checker", runner)
    assert len(leases(service)) == 1
    return runner


def closed(service: SandboxService, reason: str) -> float:
    return service.metric("clawrl_environments_leases_closed_total", reason=reason)


def test_sigterm_mid_episode_closes_the_lease_at_once(gateway, service, tmp_path):
    before = closed(service, "closed"), closed(service, "expired")
    runner = start_runner_in_checker(gateway, service, tmp_path)
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=10) == 143
    assert leases(service) == []
    assert wait_no_processes(f"sleep {SLEEP}") == []
    # Closed by the runner, not reclaimed by the reaper (which would count it expired): no
    # wall-clock bound, which a loaded host breaks.
    assert (closed(service, "closed"), closed(service, "expired")) == (before[0] + 1, before[1])
    assert not (tmp_path / "episodes.jsonl").read_text()  # the cancelled episode is no result


def test_sigkill_mid_episode_leaves_the_lease_to_its_ttl(gateway, service, tmp_path):
    before = closed(service, "closed"), closed(service, "expired")
    runner = start_runner_in_checker(gateway, service, tmp_path)
    runner.send_signal(signal.SIGKILL)
    runner.wait(timeout=10)
    assert len(leases(service)) == 1  # nobody closed it
    # A busy lease does not expire: the checker ends (SLEEP s), then the TTL runs out.
    wait_until(lambda: not leases(service), float(SLEEP) + TTL_S + 10, "the reaper")
    assert wait_no_processes(f"sleep {SLEEP}") == []
    assert (closed(service, "closed"), closed(service, "expired")) == (before[0], before[1] + 1)
    assert os.path.getsize(tmp_path / "episodes.jsonl") == 0


def mkdir_tasks(directory: Path) -> Path:
    """One train task (and its held-out twin) that greedy SmolLM2-135M solves: `mkdir backup`."""
    return family_file(directory, "mkdir", [
        {"id": "mkdir.limit", "split": "train", "max_steps": 1,
         "instruction": "Create a directory named backup.", "solution": "mkdir backup",
         "checker": "[ -d backup ]"},
    ], ["sh", "mkdir", "ls"])  # fmt: skip


def checked(episodes: list[dict]) -> list[dict]:
    """The episodes whose checker ran (the others broke off)."""
    return [e for e in episodes if e["passed"] is not None]


def test_until_stopped_with_the_held_out_split_evaluated_beside(gateway, service, tmp_path):
    # make run's terminal track: the train split over and over, the held-out split greedily for
    # the first version seen (v0) into the CSV and plot, until SIGTERM.
    out, evals = tmp_path / "episodes.jsonl", tmp_path / "agent"
    argv = runner_argv(gateway, service, mkdir_tasks(tmp_path / "tasks"), out, "--episodes", "0",
                       "--held-out-every", "1", "--eval-dir", str(evals))  # fmt: skip
    with (tmp_path / "runner.log").open("wb") as log:
        runner = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        csv = evals / "terminal-held-out.csv"
        wait_until(lambda: csv.is_file() and len(checked(lines_of(out))) >= 2, 180,
                   "two checked episodes and the held-out evaluation", runner)  # fmt: skip
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=15) == 143
    header, row = csv.read_text().splitlines()
    assert header == "policy_version,episodes,passed,success_rate,complete,elapsed_s"
    version, episodes, passed, _, complete, _ = row.split(",")
    held_out = lines_of(evals / "held-out-episodes.jsonl")
    assert [e["task_id"] for e in held_out] == ["mkdir.held"]
    assert (version, episodes, complete) == ("0", "1", "1")
    assert int(passed) == sum(e["passed"] for e in held_out)
    assert (evals / "terminal-held-out.png").read_bytes()[:4] == b"\x89PNG"
    trained = lines_of(out)
    assert {e["task_id"] for e in trained} == {"mkdir.limit"}
    # Every checked episode's outcome reached the gateway. One that broke off (on a loaded host
    # a lease of this module's 3 s TTL can lapse between heartbeats) posts none, and says why.
    assert {e["outcome"] for e in checked(trained)} == {"accepted"}
    assert all(e["error"] and not e["outcome"] for e in trained if e["passed"] is None)
    assert held_out[0]["outcome"] == "skipped"  # side turns: nothing posted
    assert leases(service) == []


def test_clawrl_eval_terminal_held_out_and_base_rate(gateway, service, tmp_path):
    tasks, out = mkdir_tasks(tmp_path / "tasks"), tmp_path / "eval"
    common = [str(VENV_BIN / "clawrl"), "eval", "--track", "terminal", "--base-url",
              gateway.base_url, "--environments-url", service.url, "--tasks-dir", str(tasks),
              "--out-dir", str(out), "--heartbeat-s", "0.5"]  # fmt: skip
    held_out = subprocess.run(common, capture_output=True, text=True, timeout=300)
    assert held_out.returncode == 0, held_out.stderr
    [episode] = lines_of(next(out.glob("eval-*.jsonl")))
    assert (episode["task_id"], episode["outcome"]) == ("mkdir.held", "skipped")
    assert episode["transcript"][0] == {
        "role": "user",
        "content": "Create a directory named backup.",
    }
    csv = (out / "terminal-held-out.csv").read_text().splitlines()
    assert csv[1].split(",")[:5] == [
        "0",
        "1",
        str(int(episode["passed"])),
        f"{episode['score']:.4f}",
        "1",
    ]

    base = subprocess.run([*common, "--base-rate", "--attempts", "2"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert base.returncode == 0, base.stderr
    played = [e for f in out.glob("eval-*.jsonl") for e in lines_of(f) if e["split"] == "train"]
    assert len(played) == 2 and {e["task_id"] for e in played} == {"mkdir.limit"}
    rows = (out / "terminal-base-rate.csv").read_text().splitlines()
    passed = sum(e["passed"] for e in played)
    assert f"train,mkdir,1,2,{passed},{passed / 2:.4f},0" in rows
    assert "| train | mkdir | 1 | 2 |" in base.stdout
    assert (out / "terminal-base-rate.png").read_bytes()[:4] == b"\x89PNG"
    assert leases(service) == []
