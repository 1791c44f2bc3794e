"""The internal Redis's objects (issue 22, point 8): a headless governing Service for its
StatefulSet, and a redis_exporter sidecar reporting the very streams the services use, scraped
once and admitted by the NetworkPolicy."""

from __future__ import annotations

import pytest

from clawrl.common.settings import RedisSettings
from clawrl.judge.settings import AuditSettings
from clawrl.trainer.weight_sync.settings import SyncSettings
from tests.helm.conftest import render


def named(objects: list[dict], kind: str, name: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(sets=("serviceMonitor.enabled=true", "redis.auth.existingSecret=redis-auth"))


def test_the_statefulset_is_governed_by_a_headless_service(objects: list[dict]) -> None:
    statefulset = named(objects, "StatefulSet", "clawrl-redis")
    governing = named(objects, "Service", statefulset["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    assert governing["spec"]["selector"] == statefulset["spec"]["selector"]["matchLabels"]
    assert [p["port"] for p in governing["spec"]["ports"]] == [6379]
    # Clients keep the ClusterIP Service the Redis URL names.
    assert named(objects, "Service", "clawrl-redis")["spec"].get("clusterIP") != "None"


def test_the_exporter_reports_the_streams_the_services_use(objects: list[dict]) -> None:
    pod = named(objects, "StatefulSet", "clawrl-redis")["spec"]["template"]["spec"]
    (exporter,) = [c for c in pod["containers"] if c["name"] == "redis-exporter"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in exporter["env"]}
    redis = RedisSettings()
    used = {redis.turns_stream, redis.samples_stream, redis.versions_stream,
            redis.deadletter_stream, SyncSettings().results_stream,
            AuditSettings().stream}  # fmt: skip
    assert set(env["REDIS_EXPORTER_CHECK_SINGLE_STREAMS"].split(",")) == used
    assert env["REDIS_ADDR"] == "redis://localhost:6379"
    assert env["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "redis-auth", "key": "password"}}
    assert [p["containerPort"] for p in exporter["ports"]] == [9121]


def test_the_exporter_is_scraped_once_and_admitted(objects: list[dict]) -> None:
    service = named(objects, "Service", "clawrl-redis")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"redis": 6379,
                                                                       "metrics": 9121}  # fmt: skip
    monitor = named(objects, "ServiceMonitor", "clawrl-redis")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    # The headless governing Service selects the same pod: the monitor skips it.
    headless = named(objects, "Service", "clawrl-redis-headless")
    assert headless["metadata"]["labels"]["clawrl.io/headless"] == "true"
    assert {"key": "clawrl.io/headless", "operator": "DoesNotExist"} in monitor["spec"]["selector"][
        "matchExpressions"
    ]
    policy = named(objects, "NetworkPolicy", "clawrl-redis")["spec"]["ingress"]
    scrape = [rule for rule in policy if rule["ports"] == [{"port": 9121}]]
    assert scrape and all("namespaceSelector" in peer for peer in scrape[0]["from"])


def test_the_exporter_can_be_left_out() -> None:
    objects = render(sets=("serviceMonitor.enabled=true", "redis.exporter.enabled=false"))
    pod = named(objects, "StatefulSet", "clawrl-redis")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["redis"]
    assert not [o for o in objects if o["kind"] == "ServiceMonitor" and "redis" in
                o["metadata"]["name"]]  # fmt: skip
    service = named(objects, "Service", "clawrl-redis")
    assert [p["port"] for p in service["spec"]["ports"]] == [6379]
