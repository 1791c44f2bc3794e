"""Whose adapter a sync moves (per-tenant mode): the tenant an announcement names or its
adapter's name gives, refused when the two disagree; and which old adapters a sync of one
tenant (or of the shared policy) may unload: its own alone."""

from __future__ import annotations

import pytest

from clawrl.common.versions import VersionReady
from clawrl.trainer.weight_sync.adapter_sync import adapter_tenant, ours
from clawrl.trainer.weight_sync.launcher import run_args
from clawrl.trainer.weight_sync.result import SyncResult


def ready(adapter: str, version: int, tenant: str = "") -> VersionReady:
    return VersionReady(version, f"/ckpt/{adapter}", 0, 0.0, adapter, tenant)


def test_the_tenant_comes_from_the_announcement_or_the_adapter_name():
    assert adapter_tenant(ready("policy-v3", 3)) == ""
    assert adapter_tenant(ready("tenant-alice-v3", 3)) == "alice"
    assert adapter_tenant(ready("tenant-alice-v3", 3, "alice")) == "alice"
    assert adapter_tenant(ready("tenant-k0a1b.c_d-v12", 12)) == "k0a1b.c_d"
    with pytest.raises(
        ValueError, match="must be the adapter tenant-bob-v3, not 'tenant-alice-v3'"
    ):
        adapter_tenant(ready("tenant-alice-v3", 3, "bob"))
    with pytest.raises(ValueError, match="tenant-alice-v4, not 'tenant-alice-v3'"):
        adapter_tenant(ready("tenant-alice-v3", 4))  # the version the gateways record
    with pytest.raises(ValueError, match="not 'policy-v3'"):
        adapter_tenant(ready("policy-v3", 3, "alice"))


def test_a_sync_unloads_only_its_own_old_adapters():
    held = ["policy-v1", "policy-v2", "tenant-alice-v1", "tenant-alice-v2", "tenant-alicia-v1",
            "tenant-bob-v1", "base-lora"]  # fmt: skip
    assert [n for n in held if ours(n, "")] == ["policy-v1", "policy-v2"]
    assert [n for n in held if ours(n, "alice")] == ["tenant-alice-v1", "tenant-alice-v2"]
    assert [n for n in held if ours(n, "bob")] == ["tenant-bob-v1"]


def test_the_job_gets_the_tenant_and_its_result_keeps_it():
    assert run_args(ready("tenant-alice-v2", 2, "alice"), "job")[-4:] == [
        "--adapter", "tenant-alice-v2", "--tenant", "alice"
    ]  # fmt: skip
    assert "--tenant" not in run_args(ready("policy-v2", 2), "job")
    result = SyncResult(2, "ok", adapter="tenant-alice-v2", tenant="alice")
    assert SyncResult.from_fields(result.fields()) == result
    assert "(adapter tenant-alice-v2 of tenant alice): ok; no pause" in result.summary()
