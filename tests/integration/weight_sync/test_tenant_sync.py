"""Tenants' adapter syncs (per-tenant mode) against two real gateway replicas, the CPU engine
serving adapters and real Redis: a tenant's sync switches that tenant alone (the shared policy's
adapter and another tenant's stay, nobody is paused, no request fails), unloads only that
tenant's old adapter, and a failed one changes nothing; the launcher follows the tenants'
versions stream (a burst collapsed to the newest per tenant), loads a tenant's served adapter
back into an engine that lost it, and a gateway that (re)starts routes every tenant to its
served adapter."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from safetensors.torch import load_file, save_file

from clawrl.common.tenants import tenant_versions_stream
from clawrl.common.versions import VersionReady
from tests.conftest import wait_until

from .conftest import MODEL, start_launcher, start_replicas, stop_launcher
from .test_lora_sync import LORA_FLAGS, loaded, tiny_adapter
from .test_weight_sync_job import results, run_sync

pytestmark = pytest.mark.integration

NAMES = ("policy-v5", "tenant-alice-v1", "tenant-alice-v2", "tenant-bob-v1", "tenant-dave-v1",
         "tenant-dave-v2")  # fmt: skip


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """One real PEFT adapter, and copies of it with their B weights scaled apart (one model
    load instead of six)."""
    root = tmp_path_factory.mktemp("tenant-adapters")
    first = tiny_adapter(root / NAMES[0], seed=10)
    tensors = load_file(str(first / "adapter_model.safetensors"))
    made = {NAMES[0]: first}
    for i, name in enumerate(NAMES[1:], 1):
        shutil.copytree(first, root / name)
        scaled = {k: v * (1 + 0.5 * i) if "lora_B" in k else v for k, v in tensors.items()}
        save_file(scaled, str(root / name / "adapter_model.safetensors"))
        made[name] = root / name
    return made


@pytest.fixture(scope="module")
def lora_engine(engine_factory) -> str:
    """test_lora_sync's engine (the same flags: one process); this module's adapter names are
    its own, and it asserts on those alone."""
    return engine_factory(MODEL, *LORA_FLAGS, "--weight-version", "0", "--random-seed", "0")


@pytest.fixture(scope="module")
def served_key() -> str:
    return f"test:{uuid.uuid4().hex[:8]}:serving"


def tenant_gateways(names, engine, redis_url, log_dir, served_key):
    env = {"CLAWRL_CONTROL__SERVED_KEY": served_key, "CLAWRL_TENANTS__MODE": "per_tenant"}
    return start_replicas(names, engine, redis_url, log_dir, env)


@pytest.fixture(scope="module")
def gateways(lora_engine, redis_url, log_dir, served_key):
    started = tenant_gateways(("tenant-a", "tenant-b"), lora_engine, redis_url, log_dir,
                              served_key)  # fmt: skip
    yield started
    for replica in started:
        replica.child.stop()


@pytest.fixture
def env(sync_env, served_key) -> dict[str, str]:
    return {**sync_env, "CLAWRL_SYNC__SERVED_KEY": served_key, "CLAWRL_TENANTS__MODE": "per_tenant"}


def ask(replica, user: str) -> httpx.Response:
    """A side turn of `user` (keys off: the `user` field names the tenant)."""
    return httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "user": user},
        headers={"X-Turn-Type": "side"},
        timeout=60,
    )


class Users(threading.Thread):
    """One client per user and replica until stopped; (user, status, fingerprint) kept."""

    def __init__(self, replicas, users):
        super().__init__(daemon=True)
        self.replicas, self.users = replicas, users
        self.stop = threading.Event()
        self.answers: list[tuple[str, int, str]] = []

    def run(self):
        while not self.stop.is_set():
            for replica in self.replicas:
                for user in self.users:
                    reply = ask(replica, user)
                    self.answers.append(
                        (user, reply.status_code, reply.json().get("system_fingerprint", ""))
                    )

    def versions(self, user: str) -> list[str]:
        return [fingerprint for who, _, fingerprint in self.answers if who == user]

    def wait_for(self, user: str, fingerprint: str) -> None:
        """Until `user`'s latest answer came from `fingerprint` (a loaded host is slow to ask)."""
        wait_until(lambda: self.versions(user)[-1:] == [fingerprint], 30, f"{user}: {fingerprint}")


def sync(env, gateways, engine, name: str, path: Path, *extra: str):
    version = name.rsplit("-v", 1)[1]
    return run_sync(env, gateways, [engine], "run", "--version", version, "--path", str(path),
                    "--adapter", name, *extra)  # fmt: skip


def test_a_tenant_sync_switches_that_tenant_alone_with_no_pause(
    gateways,
    lora_engine,
    adapters,
    env,
    served_key,
    redis_url,
):
    for name in ("policy-v5", "tenant-bob-v1"):
        done = sync(env, gateways, lora_engine, name, adapters[name])
        assert done.returncode == 0, done.stderr
    pauses = [g.metric("clawrl_gateway_pauses_total") for g in gateways]
    users = Users(gateways, ("alice", "bob", "carol"))
    users.start()
    try:
        # Each version answers alice at least once: before, between and after the syncs.
        users.wait_for("alice", "clawrl-policy-v5")
        first = sync(env, gateways, lora_engine, "tenant-alice-v1", adapters["tenant-alice-v1"])
        assert first.returncode == 0, first.stderr
        users.wait_for("alice", "clawrl-policy-v1")
        # The tenant given explicitly, as the launcher does.
        second = sync(env, gateways, lora_engine, "tenant-alice-v2", adapters["tenant-alice-v2"],
                      "--tenant", "alice")  # fmt: skip
        assert second.returncode == 0, second.stderr
        users.wait_for("alice", "clawrl-policy-v2")
    finally:
        users.stop.set()
        users.join(timeout=60)
    assert "(adapter tenant-alice-v2 of tenant alice): ok; no pause" in second.stderr
    assert [g.metric("clawrl_gateway_pauses_total") for g in gateways] == pauses
    for gateway in gateways:
        assert gateway.metric("clawrl_gateway_hold_duration_seconds_count") == 0
        status = gateway.status()
        assert (status.paused, status.policy_version, status.adapter) == (False, 5, "policy-v5")
        assert dict(status.tenant_adapters) == {"alice": "tenant-alice-v2", "bob": "tenant-bob-v1"}
    assert users.answers and all(code == 200 for _, code, _ in users.answers)
    # Alice moved from the shared policy to her v1, then v2; bob and carol never moved.
    alice = users.versions("alice")
    assert alice[0] == "clawrl-policy-v5" and alice[-1] == "clawrl-policy-v2"
    assert set(alice) == {"clawrl-policy-v5", "clawrl-policy-v1", "clawrl-policy-v2"}
    assert set(users.versions("bob")) == {"clawrl-policy-v1"}
    assert set(users.versions("carol")) == {"clawrl-policy-v5"}
    *_, one, two = results(redis_url, env["CLAWRL_SYNC__RESULTS_STREAM"])
    assert (one.tenant, one.outcome, one.adapter, one.unloaded) == (
        "alice",
        "ok",
        "tenant-alice-v1",
        0,
    )
    # Only alice's old adapter went: the shared policy's and bob's stay loaded.
    assert (two.tenant, two.outcome, two.adapter, two.unloaded) == (
        "alice",
        "ok",
        "tenant-alice-v2",
        1,
    )
    held = {k: v for k, v in loaded(lora_engine).items() if k in NAMES}
    assert held == {n: str(adapters[n]) for n in ("policy-v5", "tenant-bob-v1", "tenant-alice-v2")}
    tenants = redis.Redis.from_url(redis_url).hgetall(f"{served_key}:tenants")
    assert tenants == {
        b"alice": f"2\ttenant-alice-v2\t{adapters['tenant-alice-v2']}".encode(),
        b"bob": f"1\ttenant-bob-v1\t{adapters['tenant-bob-v1']}".encode(),
    }

    # A failed load (no such directory) switches nobody and leaves every adapter loaded.
    failed = sync(env, gateways, lora_engine, "tenant-alice-v3", adapters["policy-v5"] / "none")
    assert failed.returncode == 1, failed.stderr
    last = results(redis_url, env["CLAWRL_SYNC__RESULTS_STREAM"])[-1]
    assert (last.tenant, last.outcome, last.version) == ("alice", "failed", 3)
    for gateway in gateways:
        assert dict(gateway.status().tenant_adapters)["alice"] == "tenant-alice-v2"
    assert {k for k in loaded(lora_engine) if k in NAMES or k == "tenant-alice-v3"} == set(held)


def test_the_launcher_follows_the_tenants_stream_and_restarts_get_tenants_back(
    gateways,
    lora_engine,
    adapters,
    env,
    served_key,
    redis_url,
    log_dir,
):
    client = redis.Redis.from_url(redis_url)
    stream = tenant_versions_stream(env["CLAWRL_REDIS__VERSIONS_STREAM"])
    for name in ("tenant-dave-v1", "tenant-dave-v2"):  # a burst: only the newest is synced
        version = int(name.rsplit("-v", 1)[1])
        ready = VersionReady(version, str(adapters[name]), version, time.time(), name, "dave")
        client.xadd(stream, ready.fields())
    launcher = start_launcher(env, gateways, [lora_engine])
    restarted = []
    try:
        synced = env["CLAWRL_SYNC__RESULTS_STREAM"]
        wait_until(lambda: results(redis_url, synced), 60, "dave's sync", launcher)
        [dave] = results(redis_url, synced)
        assert (dave.tenant, dave.version, dave.outcome) == ("dave", 2, "ok")
        for gateway in gateways:
            assert dict(gateway.status().tenant_adapters)["dave"] == "tenant-dave-v2"
        # An engine that lost a tenant's adapter (as a restarted one has) gets it back.
        reply = httpx.post(f"{lora_engine}/unload_lora_adapter",
                           json={"lora_name": "tenant-dave-v2"}, timeout=30)  # fmt: skip
        assert reply.status_code == 200, reply.text
        wait_until(lambda: "tenant-dave-v2" in loaded(lora_engine), 30, "dave reloaded", launcher)
        # A gateway that (re)starts routes every tenant to its served adapter at once.
        restarted = tenant_gateways(("tenant-c",), lora_engine, redis_url, log_dir, served_key)
        status = restarted[0].status()
        assert dict(status.tenant_adapters) == dict(gateways[0].status().tenant_adapters)
        assert status.tenant_adapters["dave"] == "tenant-dave-v2"
        assert restarted[0].chat("hi").status_code == 200
        assert ask(restarted[0], "dave").json()["system_fingerprint"] == "clawrl-policy-v2"
    finally:
        stderr = stop_launcher(launcher)
        for replica in restarted:
            replica.child.stop()
    assert "lacked the served adapter tenant-dave-v2 (restarted?)" in stderr
