"""Gateways and engines converge on one version whatever died (issue 17, items 2, 10, 11 and the
fault-injection stall), against two real gateway replicas, the CPU engine and real Redis:
an expired pause lease resumes on the engine's version; a sync of a version the engines already
serve resumes gateways left behind; a "busy" sync waits for a dead job's lock; an engine that
lost the synced weights is synced again by the launcher, and its turns meanwhile are recorded as
unknown weights; a Resume for a pause another holder took is refused."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import httpx
import pytest
import redis
from redis.asyncio import Redis

from clawrl.common.proto import control_pb2, control_pb2_grpc
from clawrl.common.records import Turn, decode_entry
from clawrl.common.versions import VersionReady, announce
from clawrl.trainer.weight_sync.launcher import LocalLauncher, SyncWatcher
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

from .conftest import run_sync, tiny_dir
from .test_weight_sync_job import results

pytestmark = pytest.mark.integration


def control(replica, method: str, request):
    with grpc.insecure_channel(replica.control) as channel:
        return getattr(control_pb2_grpc.GatewayControlStub(channel), method)(request, timeout=10)


def load(engine: str, path, version: str) -> None:
    reply = httpx.post(
        f"{engine}/update_weights_from_disk",
        json={"model_path": str(path), "weight_version": version},
        timeout=120,
    )
    assert reply.status_code == 200 and reply.json()["success"], reply.text


def engine_version(engine: str) -> str:
    return httpx.get(f"{engine}/get_model_info", timeout=10).json()["weight_version"]


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def main_turn(replica, redis_url: str) -> Turn:
    """One main turn through the replica (its session done at once); the turn it recorded."""
    session = f"conv-{uuid.uuid4().hex[:8]}"
    reply = httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers={"X-Session-Id": session, "X-Session-Done": "true"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for _, fields in client.xrange("clawrl:turns"):
            turn = decode_entry(fields, Turn)
            if turn.session_id == session:
                return turn
        time.sleep(0.1)
    raise AssertionError(f"no turn recorded for {session}")


def test_an_expired_lease_resumes_on_the_engines_version(replicas, engine, checkpoints, redis_url):
    """A job that died between its load and its Resume: the gateways follow the engine, so
    their turns are not masked as mixed-policy (before: they resumed on the old version and
    every later turn differed from the engine's)."""
    load(engine, checkpoints["v1"], "7")
    for replica in replicas:
        paused = control(replica, "Pause", control_pb2.PauseRequest(lease_s=0.5, holder="dead-job"))
        assert paused.status.paused and paused.status.policy_version != 7
    for replica in replicas:
        wait_for(lambda r=replica: not r.status().paused, 10, "the lease never ended")
        assert replica.status().policy_version == 7
        adopted = replica.metric('clawrl_gateway_lease_version_adoptions_total{outcome="adopted"}')
        assert adopted == 1
    turn = main_turn(replicas[0], redis_url)
    assert (turn.policy_version, turn.admitted_policy_version, turn.unknown_weights) == (
        7,
        7,
        False,
    )


def test_a_sync_of_a_served_version_resumes_the_gateways_left_behind(
    replicas, engine, checkpoints, sync_env, redis_url
):
    """Item 10: every engine serves v8 but the gateways admit v9 (a failed Resume, a gateway
    that joined): the sync resumes them on v8 instead of skipping."""
    load(engine, checkpoints["v1"], "8")
    for replica in replicas:
        control(replica, "Resume", control_pb2.ResumeRequest(policy_version=9))
    done = run_sync(sync_env, replicas, [engine], "run", "--version", "8", "--path",
                    str(checkpoints["v1"]), "--job-id", "job-converge")  # fmt: skip
    assert done.returncode == 0, done.stderr
    [result] = results(redis_url, sync_env["CLAWRL_SYNC__RESULTS_STREAM"])
    assert (result.outcome, result.pause_s) == ("ok", 0.0)
    assert "resumed 2 gateway(s)" in result.reason
    assert [r.status().policy_version for r in replicas] == [8, 8]
    # Now engines and gateways agree: skipped.
    again = run_sync(sync_env, replicas, [engine], "run", "--version", "8", "--path",
                     str(checkpoints["v1"]))  # fmt: skip
    assert again.returncode == 0
    assert results(redis_url, sync_env["CLAWRL_SYNC__RESULTS_STREAM"])[-1].outcome == "skipped"


def test_a_resume_for_another_holders_pause_is_refused(replicas):
    """Item 11: a sync whose Pause was refused must not release the one another sync holds."""
    replica = replicas[0]
    control(replica, "Pause", control_pb2.PauseRequest(lease_s=5, holder="sync-one"))
    try:
        with pytest.raises(grpc.RpcError) as refused:
            control(replica, "Resume", control_pb2.ResumeRequest(holder="sync-two"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert replica.status().paused and replica.status().holder == "sync-one"
    finally:
        control(replica, "Resume", control_pb2.ResumeRequest(holder="sync-one"))
    assert not replica.status().paused


def test_the_launcher_waits_for_a_dead_jobs_lock_and_resyncs_an_engine_that_lost_its_weights(
    replicas, engine, checkpoints, sync_env, redis_url
):
    """The stall: a dead job's lock made each attempt "busy" until the launcher gave up. Now
    it waits for the lock, then converges; later the engine loses its weights (restarted on
    its base model): the turns it serves meanwhile are recorded as unknown weights, and the
    launcher syncs the served version into it by itself."""
    load(engine, checkpoints["v1"], "0")
    for replica in replicas:
        control(replica, "Resume", control_pb2.ResumeRequest(policy_version=3))
    settings = WeightSyncSettings(
        redis={"url": redis_url, "versions_stream": sync_env["CLAWRL_REDIS__VERSIONS_STREAM"]},
        gateways={"addresses": [r.control for r in replicas], "lease_s": 2},
        engines={"urls": [engine]},
        sync={"lock_key": sync_env["CLAWRL_SYNC__LOCK_KEY"], "lock_ttl_s": 3,
              "results_stream": sync_env["CLAWRL_SYNC__RESULTS_STREAM"],
              "served_key": sync_env["CLAWRL_SYNC__SERVED_KEY"]},
        launcher={"max_attempts": 2, "retry_backoff_s": 0.1, "reconcile_interval_s": 0.5},
    )  # fmt: skip
    metrics = WeightSyncMetrics()

    async def go() -> None:
        client = Redis.from_url(redis_url)
        # A dead job's lock, still within its TTL.
        await client.set(settings.sync.lock_key, "job-dead", px=8000)
        watcher = SyncWatcher(settings, client, LocalLauncher(settings), metrics, block_ms=200)
        task = asyncio.create_task(watcher.run_forever())
        try:
            ready = VersionReady(2, str(checkpoints["v2"]), 20, time.time())
            await announce(client, settings.redis.versions_stream, ready)
            await until(lambda: watcher.served == 2, 120)
            assert watcher.given_up == 0
            assert [r.status().policy_version for r in replicas] == [2, 2]
            assert engine_version(engine) == "2"
            # The engine loses the synced weights (as a restart would leave it); the test holds
            # the lock meanwhile, so the launcher does not fix it before the turn is served.
            await client.set(settings.sync.lock_key, "test", px=30000)
            await asyncio.to_thread(load, engine, tiny_dir(), "default")
            turn = await asyncio.to_thread(main_turn, replicas[0], redis_url)
            assert turn.unknown_weights and turn.weight_version == "default"
            assert replicas[0].metric("clawrl_gateway_unknown_weight_turns_total") >= 1
            await client.delete(settings.sync.lock_key)
            await until(lambda: engine_version(engine) == "2", 60)
            await until(lambda: all(r.status().policy_version == 2 for r in replicas), 30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()

    asyncio.run(go())
    value = metrics.registry.get_sample_value
    assert value("clawrl_weight_sync_busy_waits_total") >= 1
    assert value("clawrl_weight_sync_convergence_syncs_total", {"cause": "engines"}) >= 1
    outcomes = [r.outcome for r in results(redis_url, sync_env["CLAWRL_SYNC__RESULTS_STREAM"])]
    assert outcomes[0] == "busy" and "failed" not in outcomes, outcomes
    turn = main_turn(replicas[1], redis_url)
    assert (turn.policy_version, turn.admitted_policy_version, turn.unknown_weights) == (
        2,
        2,
        False,
    )


async def until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)
