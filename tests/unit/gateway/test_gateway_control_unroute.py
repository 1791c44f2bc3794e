"""Unrouting a tenant (issue 30): SwitchAdapter with a tenant and no adapter puts the tenant back
on the shared policy (its adapter was reset or removed, or it is no longer selected). Its next
request is admitted under the shared version and adapter, one already running keeps its own, no
one else's routing changes, its served-version series goes, and GetStatus no longer lists it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from clawrl.common.proto import control_pb2
from clawrl.gateway.control import ControlServicer, PauseGate
from clawrl.gateway.metrics import GatewayMetrics


class Aborted(Exception):
    pass


class Context:
    """The part of a grpc.aio context the servicer uses: abort raises."""

    async def abort(self, code, details):
        raise Aborted(code, details)


def gate_with_tenants() -> PauseGate:
    gate = PauseGate(GatewayMetrics(), hold_timeout_s=5, retry_after_s=1, policy_version=4,
                     adapter="policy-v4")  # fmt: skip
    gate.switch(2, "tenant-alice-v2", tenant="alice")
    gate.switch(1, "tenant-bob-v1", tenant="bob")
    return gate


async def test_an_unrouted_tenant_is_admitted_under_the_shared_policy():
    gate = gate_with_tenants()
    finish = asyncio.Event()
    admitted = asyncio.Event()

    async def running():  # admitted under alice's adapter before the unroute
        async with gate.admit("alice") as admission:
            admitted.set()
            await finish.wait()
            return admission

    task = asyncio.create_task(running())
    await admitted.wait()
    assert gate.unroute("alice") == (2, "tenant-alice-v2")
    async with gate.admit("alice") as admission:
        assert (admission.policy_version, admission.adapter) == (4, "policy-v4")
        # The shared policy moves on: she follows it, as any caller without an adapter.
        gate.switch(5, "policy-v5")
    async with gate.admit("alice") as admission:
        assert (admission.policy_version, admission.adapter) == (5, "policy-v5")
    finish.set()
    earlier = await task
    assert (earlier.policy_version, earlier.adapter) == (2, "tenant-alice-v2")
    async with gate.admit("bob") as admission:  # nobody else's routing changed
        assert (admission.policy_version, admission.adapter) == (1, "tenant-bob-v1")
    assert gate.tenant_adapters == {"bob": (1, "tenant-bob-v1")}
    assert gate.unroute("alice") is None  # again: nothing to do
    registry = gate.metrics.registry
    served = "clawrl_gateway_tenant_policy_version"
    assert registry.get_sample_value(served, {"tenant": "alice"}) is None
    assert registry.get_sample_value(served, {"tenant": "bob"}) == 1


async def test_switch_adapter_with_a_tenant_and_no_adapter_unroutes_it():
    gate = gate_with_tenants()
    servicer = ControlServicer(gate, gateway_id="g", drain_timeout_s=1)
    assert dict(servicer.status().tenant_adapters) == {
        "alice": "tenant-alice-v2",
        "bob": "tenant-bob-v1",
    }
    reply = await servicer.SwitchAdapter(
        control_pb2.SwitchAdapterRequest(tenant="alice"), Context()
    )
    assert dict(reply.status.tenant_adapters) == {"bob": "tenant-bob-v1"}
    assert (reply.status.policy_version, reply.status.adapter) == (4, "policy-v4")
    # A tenant with no adapter here: answered all the same (the launcher retries are safe).
    reply = await servicer.SwitchAdapter(control_pb2.SwitchAdapterRequest(tenant="zed"), Context())
    assert dict(reply.status.tenant_adapters) == {"bob": "tenant-bob-v1"}
    # Neither a tenant nor an adapter: refused, and the shared routing is untouched.
    for request in (
        control_pb2.SwitchAdapterRequest(),
        control_pb2.SwitchAdapterRequest(policy_version=5),
        control_pb2.SwitchAdapterRequest(adapter="policy-v5"),
    ):
        with pytest.raises(Aborted) as aborted:
            await servicer.SwitchAdapter(request, Context())
        assert aborted.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert (gate.policy_version, gate.adapter) == (4, "policy-v4")
    assert gate.metrics.registry.get_sample_value("clawrl_gateway_adapter_switches_total") == 4
