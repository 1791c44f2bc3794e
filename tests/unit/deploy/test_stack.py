"""`make run`'s process supervisor (deploy/local/stack.py): stopping it leaves nothing behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_until

sys.path.insert(0, str(REPO / "deploy/local"))
from stack import Stack


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaps counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


# A service that starts a helper process of its own (as the trainer starts Ray's), which
# outlives it; "stubborn" also ignores SIGTERM (a trainer in the middle of a long step).
SERVICES = {
    "exits": "sleep 300 & echo $! > {pidfile}; wait",
    "stubborn": "trap '' TERM; sleep 300 & echo $! > {pidfile}; while true; do sleep 0.1; done",
}


@pytest.mark.parametrize("behaviour", sorted(SERVICES))
def test_stop_takes_the_processes_a_service_started_with_it(tmp_path, behaviour) -> None:
    pidfile = tmp_path / "helper.pid"
    stack = Stack("redis://127.0.0.1:1/0", tmp_path, stop_timeout_s=1)
    stack.start(
        "service",
        ["sh", "-c", SERVICES[behaviour].format(pidfile=pidfile)],
        lambda: pidfile.is_file() and pidfile.read_text().strip() != "",
        timeout_s=10,
    )
    helper = int(pidfile.read_text())
    stack.stop()
    assert stack.procs[0][1].returncode is not None
    wait_until(lambda: not alive(helper), 5, "the helper's end (a SIGKILL takes a moment)")
