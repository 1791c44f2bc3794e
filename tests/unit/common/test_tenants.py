"""Tenants (issue 20): who a request belongs to, and who gets an adapter of their own."""

import pytest
from pydantic import ValidationError

from clawrl.common.tenants import (
    SHARED,
    TenantSettings,
    key_tenant,
    named_tenant,
    parse_tenant_adapter,
    request_tenant,
    tenant_adapter,
)
from clawrl.gateway.protocol import parse_chat_request
from clawrl.gateway.tenants import identify

HEADER = TenantSettings(header="x-clawrl-tenant")


def tenant(settings=HEADER, *, keys_on=False, credential=None, header=None, user=None):
    return request_tenant(
        settings, keys_on=keys_on, credential=credential, header_value=header, user=user
    )


def test_with_keys_on_only_the_key_names_the_tenant():
    one = tenant(keys_on=True, credential="sk-1", header="alice", user="bob")
    assert one == key_tenant("sk-1") != key_tenant("sk-2")
    assert "sk-1" not in one and one.startswith("k") and len(one) == 17
    assert tenant(keys_on=True, credential=None, user="bob") == SHARED


def test_with_keys_off_the_header_then_user_names_it_and_a_bearer_token_does_not():
    assert tenant(credential="EMPTY", header="alice", user="bob") == "alice"
    assert tenant(credential="EMPTY", user="bob") == "bob"
    assert tenant(credential="EMPTY") == SHARED
    # Without a configured header, a header value sent anyway names nobody.
    assert tenant(TenantSettings(), header="alice", user="bob") == "bob"


def test_a_name_that_cannot_name_an_adapter_is_hashed():
    assert named_tenant("team-7.eu_1") == "team-7.eu_1"
    # "shared" is the shared policy's metric label: a user of that name gets an id of its own.
    # A tenant id is also a Kubernetes label value: alphanumeric at both ends.
    for bad in ("../etc", "a b", "x" * 49, "ünï", "shared", "bob-", "bob."):
        hashed = named_tenant(bad)
        assert hashed.startswith("u") and len(hashed) == 17 and hashed == named_tenant(bad)


def test_who_owns_an_adapter():
    assert not TenantSettings().owns_adapter("alice")  # shared mode: nobody
    every = TenantSettings(mode="per_tenant")
    assert every.owns_adapter("alice") and not every.owns_adapter(SHARED)
    chosen = TenantSettings(mode="per_tenant", allow=["alice"], pattern=r"team-\d+")
    assert chosen.owns_adapter("alice") and chosen.owns_adapter("team-12")
    assert not chosen.owns_adapter("bob") and not chosen.owns_adapter("team-12x")


def test_bad_settings_fail_at_start():
    with pytest.raises(ValidationError, match="not a regular expression"):
        TenantSettings(pattern="(")
    with pytest.raises(ValidationError, match="not tenant ids"):
        TenantSettings(allow=["a/b"])
    with pytest.raises(ValidationError, match="not 'shared'"):
        TenantSettings(allow=["shared"])  # the shared policy's metric label
    with pytest.raises(ValidationError):
        TenantSettings(mode="per_user")


def test_adapter_names_round_trip():
    assert tenant_adapter("alice", 3) == "tenant-alice-v3"
    assert parse_tenant_adapter("tenant-alice-v3") == ("alice", 3)
    assert parse_tenant_adapter("tenant-k0a1b-c-v12") == ("k0a1b-c", 12)
    assert parse_tenant_adapter("policy-v3") is None


def test_the_gateway_sets_the_tenant_on_the_session():
    body = b'{"messages": [{"role": "user", "content": "hi"}], "user": "bob"}'
    headers = {"authorization": "Bearer sk-1", "x-clawrl-tenant": "alice"}
    keys_off = identify(parse_chat_request(body, headers), HEADER, False, headers)
    assert keys_off.session.tenant == "alice" and keys_off.session.user == "bob"
    keys_on = identify(parse_chat_request(body, headers), HEADER, True, headers)
    assert keys_on.session.tenant == key_tenant("sk-1")


def test_the_trainer_refuses_per_tenant_without_lora_at_start():
    from clawrl.trainer.settings import TrainerSettings

    with pytest.raises(ValidationError, match="per_tenant trains one LoRA adapter"):
        TrainerSettings(tenants={"mode": "per_tenant"})
    assert TrainerSettings(
        tenants={"mode": "per_tenant"}, lora={"enabled": True}
    ).tenants.per_tenant


def test_a_tenants_version_announcement_round_trips_and_a_shared_one_is_unchanged():
    from clawrl.common.tenants import tenant_versions_stream
    from clawrl.common.versions import VersionReady

    shared = VersionReady(3, "/c/policy/v3", 3, 1.0, adapter="policy-v3")
    assert "tenant" not in shared.fields()
    mine = VersionReady(2, "/c/policy/tenant-alice/v2", 5, 1.0, "tenant-alice-v2", "alice")
    assert VersionReady.from_fields(mine.fields()) == mine
    assert tenant_versions_stream("clawrl:versions") == "clawrl:versions:tenants"
