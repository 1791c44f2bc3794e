"""Unrouting released and de-selected tenants (issue 30): a release on the tenants' versions
stream parses apart from the versions (and is no version to re-announce); a gateway must stop
routing a tenant to a version below its floor, or any tenant no longer selected, while its new
adapter (at or past the floor) and other tenants stay; each gateway's unroute is counted, and
one that fails or does not answer makes the pass report it for another try."""

from __future__ import annotations

import pytest

from clawrl.common.proto import control_pb2
from clawrl.common.tenants import TenantSettings
from clawrl.common.versions import TenantReleased, VersionReady, tenant_entry
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.replicas import ReplicaError
from clawrl.trainer.weight_sync.settings import WeightSyncSettings
from clawrl.trainer.weight_sync.unroute import Unrouter


def unrouter(**tenants) -> Unrouter:
    settings = WeightSyncSettings(tenants=TenantSettings(mode="per_tenant", **tenants))
    return Unrouter(settings, redis=None, metrics=WeightSyncMetrics())


def test_a_release_is_an_entry_of_its_own_on_the_tenants_stream():
    released = TenantReleased("alice", 3, "remove", 12.5)
    encoded = {k.encode(): v.encode() for k, v in released.fields().items()}
    assert tenant_entry(encoded) == released
    ready = VersionReady(2, "/ckpt/tenant-alice/v2", 7, 1.0, "tenant-alice-v2", "alice")
    assert tenant_entry(ready.fields()) == ready
    for bad in ({"tenant": "alice", "floor": "x"}, {"tenant": "", "floor": "3"}, {"floor": "3"}):
        with pytest.raises(ValueError, match="malformed tenant release"):
            tenant_entry({"released": "reset", **bad})
    with pytest.raises(ValueError, match="malformed version announcement"):
        VersionReady.from_fields(released.fields())  # an older reader skips it


def test_released_versions_and_de_selected_tenants_are_strays():
    mine = unrouter(allow=["alice", "bob"])
    mine.floors["alice"] = 3
    assert mine.stray("alice", "tenant-alice-v2")  # reset since
    assert not mine.stray("alice", "tenant-alice-v3")  # her new adapter
    assert not mine.stray("bob", "tenant-bob-v1")  # never released
    assert mine.stray("carol", "tenant-carol-v4")  # taken out of allow
    assert not mine.stray("alice", "custom-lora")  # not a version of hers: left alone
    assert (mine.released("alice", 2), mine.released("alice", 3), mine.released("bob", 1)) == (
        True,
        False,
        False,
    )


class FakeGateway:
    def __init__(self, address, routes, *, down=False, refuses=False):
        self.address, self.routes = address, dict(routes)
        self.down, self.refuses = down, refuses
        self.unrouted: list[str] = []

    async def status(self):
        if self.down:
            raise ReplicaError(f"gateway {self.address}: GetStatus failed: UNAVAILABLE")
        return control_pb2.GatewayStatus(tenant_adapters=self.routes)

    async def unroute(self, tenant):
        if self.refuses:
            raise ReplicaError(f"gateway {self.address}: SwitchAdapter failed: INVALID_ARGUMENT")
        self.unrouted.append(tenant)
        del self.routes[tenant]
        return control_pb2.GatewayStatus(tenant_adapters=self.routes)


def count(mine: Unrouter, tenant: str, outcome: str) -> float | None:
    return mine.metrics.registry.get_sample_value(
        "clawrl_weight_sync_tenant_unroutes_total", {"tenant": tenant, "outcome": outcome}
    )


async def test_each_gateway_unroutes_the_strays_it_routes():
    mine = unrouter(allow=["alice", "bob"])
    mine.floors["alice"] = 3
    routes = {"alice": "tenant-alice-v2", "bob": "tenant-bob-v1", "carol": "tenant-carol-v1"}
    one = FakeGateway("g1", routes)
    two = FakeGateway("g2", {**routes, "alice": "tenant-alice-v3"})  # her new adapter there
    assert await mine._unroute([one, two], "alice") is True  # her release alone
    assert (one.unrouted, two.unrouted) == (["alice"], [])
    assert await mine._unroute([one, two], None) is True  # the convergence check: all strays
    assert (one.unrouted, two.unrouted) == (["alice", "carol"], ["carol"])
    assert one.routes == {"bob": "tenant-bob-v1"}
    assert two.routes == {"alice": "tenant-alice-v3", "bob": "tenant-bob-v1"}
    assert (count(mine, "alice", "ok"), count(mine, "carol", "ok")) == (1, 2)
    assert count(mine, "bob", "ok") is None


async def test_a_gateway_that_refuses_or_is_down_is_tried_again():
    mine = unrouter()
    mine.floors["alice"] = 2
    refusing = FakeGateway("old", {"alice": "tenant-alice-v1"}, refuses=True)
    down = FakeGateway("down", {"alice": "tenant-alice-v1"}, down=True)
    fine = FakeGateway("fine", {"alice": "tenant-alice-v1"})
    assert await mine._unroute([refusing, down, fine], "alice") is False
    assert fine.unrouted == ["alice"] and refusing.routes == {"alice": "tenant-alice-v1"}
    assert (count(mine, "alice", "ok"), count(mine, "alice", "failed")) == (1, 2)
    refusing.refuses = down.down = False
    assert await mine._unroute([refusing, down, fine], "alice") is True
    assert not refusing.routes and not down.routes
    assert count(mine, "alice", "ok") == 3
