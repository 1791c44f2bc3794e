"""A trainer killed outright (SIGKILL, OOM) must not leave its local Ray runtime behind.

Ray's actor workers run in process groups of their own, and its agents outlive the raylet while
they try to report its death to a GCS that is gone too: after a SIGKILL of the trainer,
`ray::TorchBackend`, `ray::IDLE` and the agents went on running (and holding memory) outside the
trainer's process group, which is all `make run`'s stop kills. So a trainer that starts a local
runtime also starts this reaper, in a session of its own: it notes the Ray processes below the
trainer every half second, and once the trainer is gone it kills the ones still running, then
exits. (On a Ray cluster the trainer only joins; the cluster's lifecycle is the RayJob's.)

Run as `python -m clawrl.trainer.ray_reaper <trainer pid>`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import psutil

log = logging.getLogger(__name__)

INTERVAL_S = 0.2


def is_ray(process: psutil.Process) -> bool:
    """Ray's own processes: workers (ray::...), raylet, GCS, agents, log monitor."""
    try:
        return "ray" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def ray_below(driver: psutil.Process) -> dict[int, float]:
    """pid -> start time of every Ray process below `driver` (start time: a reused pid is not
    the process noted)."""
    found = {}
    try:
        children = driver.children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        if child.pid != os.getpid() and is_ray(child):
            try:
                found[child.pid] = child.create_time()
            except psutil.Error:
                continue
    return found


def kill_left(noted: dict[int, float]) -> int:
    """SIGKILL the noted processes still running, and what they started since they were
    noted (a worker the raylet started in the last moments); how many."""
    for pid, started in list(noted.items()):
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:
                noted.update(ray_below(process))
        except psutil.Error:
            continue
    killed = 0
    for pid, started in noted.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:
                process.kill()
                killed += 1
        except psutil.Error:
            continue
    return killed


def watch(driver_pid: int) -> int:
    """Until the driver is gone; then kill what it left. How many were killed."""
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return 0
    noted: dict[int, float] = {}
    while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
        noted.update(ray_below(driver))
        time.sleep(INTERVAL_S)
    return kill_left(noted)


def start_reaper() -> subprocess.Popen:
    """The reaper of this process's local Ray runtime, in a session of its own (a signal to
    the trainer's group must not take it along before it cleaned up)."""
    return subprocess.Popen(
        [sys.executable, "-m", "clawrl.trainer.ray_reaper", str(os.getpid())],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ray-reaper %(message)s")
    try:
        driver_pid = int(sys.argv[1])
    except (IndexError, ValueError):
        sys.exit("usage: python -m clawrl.trainer.ray_reaper <trainer pid>")
    killed = watch(driver_pid)
    if killed:
        log.warning("trainer %d is gone: killed %d Ray process(es) it left", driver_pid, killed)


if __name__ == "__main__":
    main()
