"""`make run`'s status line (deploy/local/status.py) on a real Redis: in per-tenant mode a
tenant's adapter sync is not the shared policy's version, and each tenant shows its own."""

from __future__ import annotations

import sys

import pytest
import redis

from clawrl.trainer.weight_sync.job import SyncResult
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "deploy/local"))
import status

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_url):
    # A database of its own: the status line reads make run's fixed key names.
    r = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/7")
    r.flushdb()
    yield r
    r.flushdb()
    r.close()


def sync(client, version: int, outcome: str = "ok", tenant: str = "") -> None:
    adapter = f"tenant-{tenant}-v{version}" if tenant else ""
    result = SyncResult(version, outcome, adapter=adapter, tenant=tenant)
    client.xadd("clawrl:weight-syncs", result.fields())


def test_tenant_syncs_show_apart_from_the_shared_policy(client):
    sync(client, 1)
    sync(client, 3, tenant="alice")
    sync(client, 2, outcome="failed")
    sync(client, 5, tenant="alice")
    sync(client, 4, tenant="bob")
    state = status.snapshot(client, "http://127.0.0.1:9/metrics")
    assert state.policy_version == 1
    assert state.tenant_versions == {"alice": 5, "bob": 4}
    line = state.line()
    assert "policy v1 | tenants alice v5, bob v4 | last sync bob v4 ok" in line


def test_shared_mode_line_is_unchanged(client):
    sync(client, 1)
    sync(client, 2)
    state = status.snapshot(client, "http://127.0.0.1:9/metrics")
    assert (state.policy_version, state.tenant_versions) == (2, {})
    assert "policy v2 | last sync v2 ok" in state.line()


def test_batches_without_signal_show_beside_the_steps(client):
    """A loop that only skips (every turn neutral) must not look like one that learns: the
    trainer's skipped batches are read from its /metrics and shown beside the steps."""
    from prometheus_client import start_http_server

    from clawrl.trainer.metrics import TrainerMetrics

    metrics = TrainerMetrics()
    metrics.step.set(2)
    metrics.batches_skipped.labels("no_signal").inc(30)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        state = status.snapshot(client, url)
    finally:
        server.shutdown()
        thread.join()
    assert (state.steps, state.skipped) == (2, 30)
    assert "| steps 2 (30 batches without signal skipped) |" in state.line()
    assert "skipped" not in status.Snapshot(steps=2).line()
