"""The chart's `helm test` hook as rendered: a test-hook Pod that reaches the gateway's Service
(with a key when the gateway needs one) and Redis (its URL and password as the services get
them), allowed by the NetworkPolicies; NOTES says how to run it. The script itself runs against
a real gateway in tests/integration/gateway/test_helm_test_hook.py."""

from __future__ import annotations

from tests.helm.conftest import CHART, CLUSTER_VALUES, helm, render
from tests.helm.test_broadcast_chart import admits


def hook_pod(objects: list[dict]) -> dict:
    (pod,) = [o for o in objects if o["kind"] == "Pod"]
    return pod


def env_of(pod: dict) -> dict:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_hook_pod_checks_the_gateway_and_redis() -> None:
    objects = render(sets=("gateway.apiKeys={sk-1}", "redis.auth.existingSecret=redis-auth"))
    pod = hook_pod(objects)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    env = env_of(pod)
    gateway = next(o for o in objects if o["kind"] == "Service" and
                   o["metadata"]["name"] == "clawrl-gateway")  # fmt: skip
    assert env["GATEWAY_URL"] == f"http://clawrl-gateway:{gateway['spec']['ports'][0]['port']}"
    assert env["CLAWRL_REDIS__URL"] == "redis://:$(REDIS_PASSWORD)@clawrl-redis:6379/0"
    assert env["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "redis-auth", "key": "password"}}
    assert env["TURNS_STREAM"] == "clawrl:turns"
    # A probe turn: recorded, never trained (the judge masks it); the script checks the mark.
    (container,) = pod["spec"]["containers"]
    assert '"X-Turn-Type": "probe"' in container["args"][0]
    assert "Turn).probe" in container["args"][0]
    # The gateway's own key Secret, mounted where the script reads it.
    (keys,) = [v for v in pod["spec"]["volumes"] if v["name"] == "api-keys"]
    assert keys["secret"]["secretName"] == "clawrl-gateway"
    (container,) = pod["spec"]["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert env["API_KEYS_FILE"] == f"{mount['mountPath']}/api-keys"
    # Its labels get it through to the gateway's serving port and to Redis.
    redis = next(o for o in objects if o["kind"] == "StatefulSet")["spec"]["template"]
    gateway_pod = next(o for o in objects if o["kind"] == "Deployment" and
                       o["metadata"]["name"] == "clawrl-gateway")["spec"]["template"]  # fmt: skip
    assert admits(objects, pod, gateway_pod, 30000)
    assert admits(objects, pod, redis, 6379)


def test_without_keys_nothing_is_mounted_and_the_stream_follows_the_settings() -> None:
    pod = hook_pod(render(sets=("gateway.settings.redis.turns_stream=prod:turns",)))
    assert not [v for v in pod["spec"]["volumes"] if v["name"] == "api-keys"]
    assert env_of(pod)["TURNS_STREAM"] == "prod:turns"
    assert not [o for o in render(sets=("gateway.enabled=false",)) if o["kind"] == "Pod"]


def test_notes_tell_how_to_run_it() -> None:
    result = helm("install", "clawrl", str(CHART), "--dry-run=client", "--namespace", "ml",
                  "-f", str(CLUSTER_VALUES), "--set", "serviceMonitor.enabled=true")  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "helm test clawrl -n ml" in notes
    assert "PrometheusRule clawrl-alerts" in notes
    assert 'folder "clawrl"' in notes
