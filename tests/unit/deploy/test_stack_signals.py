"""`make run`'s supervisor (deploy/local/stack.py) under signals: a second stop signal does not
abort the stop halfway, and the services die with a supervisor that is killed outright."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO, wait_until
from tests.unit.deploy.test_stack import alive

SERVICES = 3
# A service that notes each SIGTERM and goes on (a trainer in the middle of a long step): only
# the stop's SIGKILL, after its timeout, ends it.
STUBBORN = """
import os, signal, sys, time
log = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *_: open(log, "a").write("TERM\\n"))
open(log, "a").write(f"{os.getpid()}\\n")
time.sleep(300)
"""
# stack.py's main in small: the same Stack, signal handling and stop, with stubborn services.
SUPERVISOR = """
import sys
from pathlib import Path
sys.path.insert(0, {deploy!r})
import stack
logs = Path({logs!r})
supervisor = stack.Stack("redis://127.0.0.1:1/0", logs, stop_timeout_s=3)
stack.stop_on_signals()
try:
    for i in range({services}):
        log = logs / f"service-{{i}}.pids"
        supervisor.start(f"service {{i}}", [sys.executable, "-c", {stubborn!r}, str(log)],
                         lambda log=log: log.is_file(), timeout_s=30)
    print("services up", flush=True)
    supervisor.wait(lambda: "", interval_s=60)
except KeyboardInterrupt:
    print("stopping", flush=True)
finally:
    supervisor.stop()
print("stopped", flush=True)
"""


def service_pids(logs: Path) -> list[int]:
    return [int((logs / f"service-{i}.pids").read_text().split()[0]) for i in range(SERVICES)]


def terms_received(logs: Path) -> int:
    return sum((logs / f"service-{i}.pids").read_text().count("TERM") for i in range(SERVICES))


@contextlib.contextmanager
def supervisor(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """The running supervisor (in a process group of its own) and its services' pids; whatever
    is left of them is killed after the test."""
    script = SUPERVISOR.format(deploy=str(REPO / "deploy/local"), logs=str(tmp_path),
                               services=SERVICES, stubborn=STUBBORN)  # fmt: skip
    out = (tmp_path / "supervisor.out").open("w+")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=REPO)  # fmt: skip
    pids: list[int] = []
    try:
        wait_until(lambda: "services up" in (tmp_path / "supervisor.out").read_text(), 60,
                   "the supervisor's services", proc)  # fmt: skip
        pids = service_pids(tmp_path)
        yield proc, pids
    finally:
        for pid in [proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_second_term_during_the_stop_does_not_abort_it(tmp_path) -> None:
    with supervisor(tmp_path) as (proc, pids):
        os.killpg(proc.pid, signal.SIGTERM)
        # Every service got its TERM: the stop is waiting out their timeout.
        wait_until(lambda: terms_received(tmp_path) == SERVICES, 30, "the stop's TERMs", proc)
        os.killpg(proc.pid, signal.SIGTERM)  # a supervisor or harness that stops in two places
        rc = proc.wait(timeout=60)
        out = (tmp_path / "supervisor.out").read_text()
        assert rc == 0, out
        assert out.splitlines()[-2:] == ["stopping", "stopped"]
        wait_until(lambda: not any(alive(pid) for pid in pids), 10, "the services' end")


def test_the_services_die_with_a_supervisor_killed_outright(tmp_path) -> None:
    with supervisor(tmp_path) as (proc, pids):
        assert all(alive(pid) for pid in pids)
        os.killpg(proc.pid, signal.SIGKILL)  # no stop at all: the OOM killer, kill -9
        proc.wait()
        wait_until(lambda: not any(alive(pid) for pid in pids), 10, "the orphaned services' end")
