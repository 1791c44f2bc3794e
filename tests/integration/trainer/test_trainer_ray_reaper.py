"""A trainer killed with SIGKILL leaves no Ray process behind (issue 17, "Also seen"): its
actor workers run in process groups of their own and Ray's agents outlived the raylet, so they
kept running after the trainer's group was gone. The local runtime's reaper kills them."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.integration

DRIVER = """
import os, ray
from clawrl.trainer.driver import connect
from clawrl.trainer.settings import RaySettings

connect(RaySettings(num_cpus=1))

@ray.remote
class Backend:
    def pid(self):
        return os.getpid()

backend = Backend.remote()
print("actor", ray.get(backend.pid.remote()), flush=True)
import time
time.sleep(600)
"""


def ray_processes(root: psutil.Process) -> list[psutil.Process]:
    return [
        p for p in root.children(recursive=True) if "ray" in " ".join(p.cmdline()) and
        "ray_reaper" not in " ".join(p.cmdline())
    ]  # fmt: skip


def test_a_sigkilled_trainer_leaves_no_ray_process(tmp_path):
    out = tmp_path / "driver.out"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER],
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
    )
    left: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while "actor " not in out.read_text():
            assert time.monotonic() < deadline and driver.poll() is None, out.read_text()
            time.sleep(0.2)
        actor_pid = int(out.read_text().split("actor ")[1].split()[0])
        time.sleep(1.5)  # the reaper has noted them
        left = ray_processes(psutil.Process(driver.pid))
        assert actor_pid in {p.pid for p in left}
        assert any("raylet" in " ".join(p.cmdline()) for p in left)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs(left, timeout=20)
        assert not alive, [(p.pid, p.cmdline()[:1]) for p in alive]
    finally:
        driver.kill()
        for process in [*left, *ray_processes(psutil.Process())]:
            with contextlib.suppress(psutil.Error):
                process.kill()
