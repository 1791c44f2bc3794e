"""GatewayControl is never open to whoever reaches it (issue 30, after AReaL refusing its
default admin key on a non-loopback bind): the gateway refuses to start with control bound
beyond loopback and no token, unless told a network policy guards the port. The chart says so
only when its NetworkPolicy is on, and refuses to render with neither a token nor the policy."""

from __future__ import annotations

import pytest

from clawrl.gateway.settings import GatewaySettings

from .conftest import CHART, CLUSTER_VALUES, helm, render


def gateway_settings(objects: list[dict], monkeypatch) -> GatewaySettings:
    """The settings the rendered gateway container starts with (its literal env values)."""
    (gateway,) = [o for o in objects if o["kind"] == "Deployment"
                  and o["metadata"]["name"].endswith("-gateway")]  # fmt: skip
    env = gateway["spec"]["template"]["spec"]["containers"][0]["env"]
    for item in env:
        if item["name"].startswith("CLAWRL_CONTROL__"):
            monkeypatch.setenv(item["name"], item.get("value") or "from-the-secret")
    return GatewaySettings()


def test_without_a_token_the_network_policy_guards_control(default_objects, monkeypatch):
    settings = gateway_settings(default_objects, monkeypatch)
    assert (settings.control.host, settings.control.token) == ("0.0.0.0", None)
    assert settings.control.allow_unauthenticated
    policies = [o for o in default_objects if o["kind"] == "NetworkPolicy"]
    assert policies  # what the flag stands for


def test_with_a_token_control_needs_it(monkeypatch):
    objects = render(sets=("gateway.controlTokenSecret=control-token",))
    settings = gateway_settings(objects, monkeypatch)
    assert settings.control.token is not None and not settings.control.allow_unauthenticated


def test_neither_a_token_nor_the_network_policy_is_refused():
    result = helm("template", "clawrl", str(CHART), "-f", str(CLUSTER_VALUES),
                  "--set", "networkPolicy.enabled=false")  # fmt: skip
    assert result.returncode != 0
    assert "gateway: set controlTokenSecret, or keep networkPolicy.enabled" in result.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.ml.svc"])
def test_the_gateway_refuses_an_open_control_port_beyond_loopback(host):
    with pytest.raises(ValueError, match=r"control\.token is unset"):
        GatewaySettings(control={"host": host})
    assert GatewaySettings(control={"host": host, "token": "t"}).control.host == host
    guarded = GatewaySettings(control={"host": host, "allow_unauthenticated": True})
    assert guarded.control.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_control_needs_no_token(host):
    assert GatewaySettings(control={"host": host}).control.token is None
