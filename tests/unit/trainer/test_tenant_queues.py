"""Per-tenant batches (issue 20): each sample trains one adapter, a tenant's step holds only its
own samples, and a busy tenant never starves a quiet one."""

from clawrl.common.tenants import SHARED, TenantSettings
from clawrl.trainer.tenants import TenantQueues, adapter_of

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
