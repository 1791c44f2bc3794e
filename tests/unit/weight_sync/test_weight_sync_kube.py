"""The Kubernetes Job the launcher builds from the chart's template (the shape the chart's
weight-sync ConfigMap holds), checked by kubernetes-validate against the Kubernetes schema."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from clawrl.common.versions import VersionReady
from clawrl.trainer.weight_sync.kube import build_job, job_name, load_template

TEMPLATE = yaml.safe_load("""
apiVersion: batch/v1
kind: Job
metadata:
  generateName: clawrl-weight-sync-
  namespace: ml
  labels: {app.kubernetes.io/name: clawrl}
spec:
  backoffLimit: 2
  template:
    metadata:
      labels: {app.kubernetes.io/name: clawrl}
    spec:
      automountServiceAccountToken: false
      containers:
        - name: weight-sync
          image: clawrl-trainer:0.1.0
          command: [clawrl-weight-sync]
          env:
            - {name: CLAWRL_GATEWAYS__SERVICE, value: clawrl-gateway-headless}
""")

READY = VersionReady(version=12, path="/ckpt/policy/v12", step=240, created_at=0.0)


def test_job_for_a_version_runs_that_sync_and_is_a_valid_job():
    job = build_job(TEMPLATE, READY, timeout_s=900, suffix="a1b2c3")
    assert job["metadata"]["name"] == "clawrl-weight-sync-v12-a1b2c3"
    assert "generateName" not in job["metadata"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["clawrl-weight-sync"]
    assert container["args"] == [
        "run", "--version", "12", "--path", "/ckpt/policy/v12",
        "--job-id", "clawrl-weight-sync-v12-a1b2c3",
    ]  # fmt: skip
    for meta in (job["metadata"], job["spec"]["template"]["metadata"]):
        assert meta["labels"]["clawrl.io/policy-version"] == "12"
        assert meta["labels"]["app.kubernetes.io/component"] == "weight-sync"
        assert meta["labels"]["app.kubernetes.io/name"] == "clawrl"
    spec = job["spec"]
    # The template's choices stay; what it leaves open gets the launcher's defaults.
    assert spec["backoffLimit"] == 2
    assert spec["activeDeadlineSeconds"] == 900 and spec["ttlSecondsAfterFinished"] == 600
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    kubernetes_validate.validate(job, "1.30.0", strict=True)
    assert TEMPLATE["metadata"]["generateName"] == "clawrl-weight-sync-"  # not modified


def test_the_job_of_a_lora_version_names_its_adapter():
    ready = VersionReady(version=12, path="/ckpt/policy/v12", step=240, created_at=0.0,
                         adapter="policy-v12")  # fmt: skip
    job = build_job(TEMPLATE, ready, timeout_s=900, suffix="a1b2c3")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "run", "--version", "12", "--path", "/ckpt/policy/v12",
        "--job-id", "clawrl-weight-sync-v12-a1b2c3", "--adapter", "policy-v12",
    ]  # fmt: skip
    assert "clawrl.io/tenant" not in job["metadata"]["labels"]  # the shared policy's


def test_the_job_of_a_tenants_adapter_is_labelled_with_the_tenant():
    ready = VersionReady(version=3, path="/ckpt/tenants/team-7.eu/v3", step=40, created_at=0.0,
                         adapter="tenant-team-7.eu-v3", tenant="team-7.eu")  # fmt: skip
    job = build_job(TEMPLATE, ready, timeout_s=900, suffix="a1b2c3")
    for meta in (job["metadata"], job["spec"]["template"]["metadata"]):
        assert meta["labels"]["clawrl.io/tenant"] == "team-7.eu"  # kubectl get jobs -l ...
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == [
        "--tenant",
        "team-7.eu",
    ]
    kubernetes_validate.validate(job, "1.30.0", strict=True)


def test_names_fit_kubernetes_limits():
    name = job_name("A_Very.Long-Release-Name-" * 4, 123456, "ffffff")
    assert len(name) <= 63 and name.endswith("-v123456-ffffff")
    assert name == name.lower() and "_" not in name and "." not in name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update(kind="Deployment"), "batch/v1 Job"),
        (lambda t: t["spec"]["template"]["spec"]["containers"][0].update(name="x"), "weight-sync"),
    ],
)
def test_a_template_without_the_sync_container_is_refused(change, message):
    template = copy.deepcopy(TEMPLATE)
    change(template)
    with pytest.raises(ValueError, match=message):
        build_job(template, READY, timeout_s=900, suffix="000000")


def test_template_file_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_template(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="not a mapping"):
        load_template(tmp_path / "list.yaml")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(TEMPLATE))
    assert load_template(tmp_path / "job.yaml") == TEMPLATE
