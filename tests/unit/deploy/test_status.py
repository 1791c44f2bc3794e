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
