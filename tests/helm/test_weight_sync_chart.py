"""The chart's weight-sync pieces against the launcher's own code: the Job it builds from the
rendered template for a version is a valid Job that runs that sync under the labels the
gateway's NetworkPolicy admits, and the rendered environment builds WeightSyncSettings."""

from __future__ import annotations

import kubernetes_validate
import yaml

from clawrl.common.versions import VersionReady
from clawrl.trainer.weight_sync.kube import build_job
from tests.helm.conftest import pod_specs

READY = VersionReady(version=7, path="/checkpoints/policy/v7", step=70, created_at=0.0)


def template(objects: list[dict]) -> dict:
    (config,) = [o for o in objects if o["kind"] == "ConfigMap" and "job.yaml" in o["data"]]
    return yaml.safe_load(config["data"]["job.yaml"])


def test_the_launcher_builds_a_valid_job_from_the_rendered_template(
    default_objects: list[dict],
) -> None:
    job = build_job(template(default_objects), READY, timeout_s=900, suffix="a1b2c3")
    for version in ("1.30.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(job, version, strict=True)
    name = job["metadata"]["name"]
    assert name.startswith("clawrl-weight-sync-v7-")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["clawrl-weight-sync"]
    assert container["args"] == ["run", "--version", "7", "--path", READY.path, "--job-id", name]
    # The gateway admits GatewayControl calls from pods with these labels.
    gateway_policy = next(
        o for o in default_objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "clawrl-gateway"
    )  # fmt: skip
    control = next(rule for rule in gateway_policy["spec"]["ingress"] if "from" in rule)
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert any(
        all(pod_labels.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items())
        for peer in control["from"]
    )
    assert job["spec"]["backoffLimit"] == 0  # retries are the launcher's


def test_the_manual_run_is_the_same_job_for_the_newest_version(default_objects: list[dict]) -> None:
    cronjob = next(o for o in default_objects if o["kind"] == "CronJob")
    ((_, spec),) = list(pod_specs(cronjob))
    assert spec["containers"][0]["args"] == ["run"]
