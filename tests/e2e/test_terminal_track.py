"""`make run RUN_ARGS="--track terminal"` end to end, with the tiny model (it never calls a tool,
so every episode fails: the mechanics are tested, not the policy): the sandbox service and the
agent runner come up beside the learning loop, the runner's episodes post their outcomes, the
judge's samples of those turns carry the outcome as their reward (the outcome alone, prm step
coefficient 0), the held-out split is evaluated for v0, and a stop leaves no sandbox."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from clawrl.common.records import Sample, decode_entry
from tests.conftest import REPO, free_port, wait_until
from tests.e2e.local_stack import local_stack

sys.path.insert(0, str(REPO / "deploy/local"))
import terminal

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.fixture(scope="module")
def terminal_stack(tmp_path_factory) -> Iterator[tuple[dict[str, int], Path]]:
    run_dir = tmp_path_factory.mktemp("terminal")
    extra = {"environments": free_port(), "runner-metrics": free_port()}
    args = ("--track", "terminal", "--terminal-families", "make_dir", "--held-out-every", "1",
            "--environments-port", str(extra["environments"]),
            "--runner-metrics-port", str(extra["runner-metrics"]))  # fmt: skip
    with local_stack(run_dir, ("gateway", "/readyz"), *args) as ports:
        yield {**ports, **extra}, run_dir
    root = terminal.sandbox_root(run_dir)
    assert list(root.iterdir()) == []  # every sandbox went with the stop
    root.rmdir()
    assert (run_dir / "agent" / "episodes.jsonl").read_text()  # what the runner wrote is kept


def episodes(run_dir: Path) -> list[dict]:
    path = run_dir / "agent" / "episodes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_episodes_post_outcomes_that_reach_the_samples(terminal_stack) -> None:
    ports, run_dir = terminal_stack
    wait_until(lambda: len(episodes(run_dir)) >= 2, 300, "two episodes")
    played = episodes(run_dir)
    assert {e["family"] for e in played} == {"make_dir"} and {e["split"] for e in played} == {
        "train"
    }
    assert {(e["passed"], e["outcome"], e["error"]) for e in played} == {(False, "accepted", "")}
    sessions = {e["session_id"]: e["task_id"] for e in played}
    store = redis.Redis(port=ports["redis"])

    def samples() -> list[Sample]:
        found = [decode_entry(fields, Sample) for _, fields in store.xrange("clawrl:samples")]
        return [s for s in found if s.session_id in sessions]

    wait_until(lambda: len(samples()) >= 2, 120, "the samples of the episodes' turns")
    for sample in samples():
        assert sample.HasField("outcome") and sample.outcome == 0.0
        assert sample.task_id == sessions[sample.session_id]
        assert sample.reward == -1.0  # (2 * 0 - 1) + 0 * step score
    metrics = httpx.get(f"http://127.0.0.1:{ports['runner-metrics']}/metrics", timeout=5).text
    assert 'clawrl_agent_episodes_total{family="make_dir",result="failed",split="train"}' in (
        metrics
    )


def test_the_held_out_split_is_evaluated_for_v0(terminal_stack) -> None:
    _, run_dir = terminal_stack
    csv = run_dir / "agent" / "terminal-held-out.csv"
    deadline = time.monotonic() + 300
    while not csv.exists() and time.monotonic() < deadline:
        time.sleep(1)
    lines = csv.read_text().splitlines()
    assert lines[1].split(",")[:5] == ["0", "2", "0", "0.0000", "1"]  # 2 held-out tasks, failed
