"""Per-tenant routing (issue 20): a SwitchAdapter with a tenant changes only that tenant's
requests; everyone else keeps the shared adapter, and a shared switch leaves the tenant's."""

from __future__ import annotations

import dataclasses

import pytest

from clawrl.common.sglang_client import EngineRequestError
from tests.unit.gateway.test_gateway_adapter_routing import request, served

__all__ = ["served"]  # the fixture: an engine holding policy-v4 only, listing each lora_path


def of(tenant: str, **body):
    chat = request(**body)
    chat.session = dataclasses.replace(chat.session, tenant=tenant)
    return chat


async def test_a_tenant_switch_routes_that_tenant_alone(served):
    service, seen = served
    service.gate.switch(4, "policy-v4")
    service.gate.switch(1, "tenant-alice-v1", tenant="alice")
    with pytest.raises(
        EngineRequestError
    ):  # the scripted engine lacks alice's adapter (a 503 to the client)
        await service.complete(of("alice"))
    body, _ = await service.complete(of("bob"))
    assert body["system_fingerprint"] == "clawrl-policy-v4"
    await service.complete(of(""))
    service.gate.switch(5, "policy-v5")  # the shared policy moves on; alice's stays
    with pytest.raises(EngineRequestError):
        await service.complete(of("bob"))
    with pytest.raises(EngineRequestError):
        await service.complete(of("alice"))
    assert seen == ["tenant-alice-v1", "policy-v4", "policy-v4", "policy-v5", "tenant-alice-v1"]
    assert service.gate.tenant_adapters == {"alice": (1, "tenant-alice-v1")}
    # Counted per tenant served an adapter of its own; every other caller (bob, no tenant) is
    # "shared", so the label stays bounded by the adapters switched in.
    registry = service.gate.metrics.registry

    def requests(tenant: str) -> float | None:
        return registry.get_sample_value("clawrl_gateway_tenant_requests_total", {"tenant": tenant})

    assert (requests("alice"), requests("shared"), requests("bob")) == (2.0, 3.0, None)
    served_version = "clawrl_gateway_tenant_policy_version"
    assert registry.get_sample_value(served_version, {"tenant": "alice"}) == 1
