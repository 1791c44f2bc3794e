"""Fault injection: the launcher's process group SIGKILLed while its sync job holds the gateways
paused and the engine has loaded the new version (the stall of issue 17: the lease resumed the
gateways on the old version, the restarted launcher got "busy" until it gave up, and every later
turn was masked as mixed-policy). Restarted with the same argv, everything converges on the
newest version by itself and turns are recorded as trainable again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from clawrl.common.proto import control_pb2
from tests.conftest import free_port, wait_until

from .conftest import sync_argv
from .test_weight_sync_converge import control, engine_version, load, main_turn, wait_for
from .test_weight_sync_job import LongGeneration, announce_version, tokens_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def start_launcher(replicas, engine, env, log, port):
    """The launcher, once it answers on its metrics port."""
    launcher = subprocess.Popen(
        sync_argv(replicas, [engine], "watch", "--metrics-port", str(port)),
        env={**os.environ, **env},
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own group: killed as `make run` kills one
    )
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).status_code == 200,
        120, "launcher", launcher,
    )  # fmt: skip
    return launcher


def test_a_launcher_killed_mid_sync_converges_by_itself(
    replicas, engine, checkpoints, sync_env, redis_url, tmp_path
):
    load(engine, checkpoints["v1"], "1")
    for replica in replicas:
        control(replica, "Resume", control_pb2.ResumeRequest(policy_version=1))
    env = {
        **sync_env,
        "CLAWRL_GATEWAYS__LEASE_S": "2",
        "CLAWRL_SYNC__LOCK_TTL_S": "6",
        "CLAWRL_LAUNCHER__RECONCILE_INTERVAL_S": "1",
        "CLAWRL_LAUNCHER__RETRY_BACKOFF_S": "0.5",
        # The sync waits for the long generation below: it holds the gateways paused a while.
        "CLAWRL_GATEWAYS__DRAIN_TIMEOUT_S": "60",
        "CLAWRL_ENGINES__IN_FLIGHT": "wait",
    }
    log = tmp_path / "launcher.log"
    port = free_port()
    launcher = start_launcher(replicas, engine, env, log, port)
    long = LongGeneration(replicas[0], tokens_for(engine, 40))
    try:
        long.started()
        announce_version(redis_url, env["CLAWRL_REDIS__VERSIONS_STREAM"], 2, checkpoints["v2"])
        # Its job pauses the gateways: kill the launcher's whole group (the job with it).
        wait_for(
            lambda: all(r.status().holder.startswith("sync-v2") for r in replicas),
            120,
            f"the sync never paused the gateways: {log.read_text()[-2000:]}",
        )
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        # The engine had loaded v2 when it died (the job loads before it resumes).
        if engine_version(engine) != "2":
            load(engine, checkpoints["v2"], "2")
        launcher = start_launcher(replicas, engine, env, log, port)
        # Gateways and engine converge on v2 with no new announcement.
        wait_for(
            lambda: all(
                (s.paused, s.policy_version) == (False, 2) for s in (r.status() for r in replicas)
            ),
            60,
            f"the gateways never converged: {log.read_text()[-3000:]}",
        )
        assert engine_version(engine) == "2"
        long.join(timeout=300)  # the engine is free again for the turns below
        assert long.reply is not None and long.reply.status_code == 200
        for replica in replicas:
            turn = main_turn(replica, redis_url)
            assert (turn.policy_version, turn.admitted_policy_version) == (2, 2)
            assert not turn.unknown_weights
        # The loop is not stalled: the next version is synced.
        announce_version(redis_url, env["CLAWRL_REDIS__VERSIONS_STREAM"], 3, checkpoints["v1"])
        wait_for(
            lambda: (
                all(r.status().policy_version == 3 for r in replicas)
                and engine_version(engine) == "3"
            ),
            120,
            f"v3 was never synced: {log.read_text()[-3000:]}",
        )
        assert launcher.poll() is None
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        print(log.read_text()[-3000:], file=sys.stderr)
