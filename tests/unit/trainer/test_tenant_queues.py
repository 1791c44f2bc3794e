"""Per-tenant batches (issue 20): each sample trains one adapter, a tenant's step holds only its
own samples, and a busy tenant never starves a quiet one."""

from clawrl.common.tenants import SHARED, TenantSettings
from clawrl.trainer.tenants import (
    RESET,
    SERVED_SHARED,
    UNROUTED,
    TenantQueues,
    Unroutable,
    adapter_of,
    route,
)

PER_TENANT = TenantSettings(mode="per_tenant", min_samples_per_step=2, max_adapters=2)


def test_who_trains_which_adapter():
    assert adapter_of("alice", TenantSettings(), set()) == SHARED  # shared mode
    assert adapter_of("alice", PER_TENANT, set()) == "alice"
    assert adapter_of(SHARED, PER_TENANT, set()) == SHARED
    full = {"alice", "bob"}
    assert adapter_of("alice", PER_TENANT, full) == "alice"
    assert adapter_of("carol", PER_TENANT, full) == SHARED  # no room: the shared policy
    allow = TenantSettings(mode="per_tenant", allow=["alice"])
    assert adapter_of("bob", allow, set()) == SHARED


def test_a_step_holds_one_tenants_samples_and_each_sample_once():
    queues = TenantQueues(PER_TENANT, batch_size=3)
    for i, tenant in enumerate(["alice", "bob", "alice", SHARED, "carol", "bob", SHARED]):
        queues.put(tenant, (tenant, i))
    assert queues.overflow == 1  # carol: over max_adapters, trained shared
    batches = []
    while (ready := queues.pop_ready()) is not None:
        batches.append(ready)
    assert batches == [
        ("alice", [("alice", 0), ("alice", 2)]),
        ("bob", [("bob", 1), ("bob", 5)]),
        (SHARED, [(SHARED, 3), ("carol", 4), (SHARED, 6)]),
    ]
    assert queues.held() == []


def test_a_busy_tenant_does_not_starve_a_quiet_one():
    queues = TenantQueues(PER_TENANT, batch_size=2)
    order = []
    for i in range(40):
        queues.put("busy", i)  # a full batch every other sample
        if i % 8 == 0:
            queues.put("quiet", i)  # one a fourth as often
        while (ready := queues.pop_ready()) is not None:
            order.append(ready[0])
    quiet_steps = [n for n, adapter in enumerate(order) if adapter == "quiet"]
    assert len(quiet_steps) == 2 and order.count("busy") == 20
    # The quiet tenant's batch went first once it had one, ahead of the busy tenant's next.
    queues = TenantQueues(PER_TENANT, batch_size=2)
    for i in range(4):
        queues.put("busy", i)
    queues.put("quiet", 0)
    queues.put("quiet", 1)
    assert [queues.pop_ready()[0] for _ in range(3)] == ["busy", "quiet", "busy"]


def test_a_sample_trains_the_adapter_that_served_it():
    """Issue 30: the adapter that served a turn trains on it; a reset or remove drops what its
    old versions served; a tenant taken out of `allow` keeps no adapter."""

    def routed(tenant, served_by, settings=PER_TENANT, owners=("alice",), removed=()):
        return route(tenant, served_by, settings, set(owners), {"alice": 2}, {"alice": 2},
                     set(removed))  # fmt: skip

    assert routed("alice", "tenant-alice-v2") == "alice"
    assert routed("alice", "tenant-alice-v1") == RESET  # below her floor: since reset
    # v2 is hers, yet the shared policy served this one (a sync's lag): neither trains on it.
    assert routed("alice", "") == SERVED_SHARED == Unroutable("tenant_served_shared")
    assert routed("alice", "policy-v7") == SERVED_SHARED
    assert routed("bob", "") == "bob"  # a new adapter starts from the shared policy's turns
    assert routed("bob", "tenant-alice-v2") == "bob"  # another tenant's name: not bob's
    assert routed("bob", "", removed=["bob"]) == SHARED
    assert routed("alice", "tenant-alice-v2", removed=["alice"]) == UNROUTED
    only_bob = TenantSettings(mode="per_tenant", allow=["bob"])
    assert routed("alice", "tenant-alice-v2", only_bob) == UNROUTED  # taken out of allow
    assert routed("alice", "", only_bob) == SHARED


def test_releasing_a_tenant_frees_its_slot_and_hands_back_its_samples():
    queues = TenantQueues(PER_TENANT, batch_size=3)
    for i, tenant in enumerate(["alice", "bob", "carol", "alice"]):
        queues.put(tenant, (tenant, i))
    assert queues.owners == {"alice", "bob"} and queues.overflow == 1
    assert queues.release("alice") == [("alice", 0), ("alice", 3)]
    assert queues.put("carol", ("carol", 4)) == "carol"  # the freed slot
    assert queues.owners == {"bob", "carol"}
