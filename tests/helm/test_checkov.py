"""checkov (PyPI, in its own venv: scripts/install-checkov.py) on the rendered chart: the default
values, every example values file and every image pinned by digest. Any finding not accepted in
checkov-skips.yaml fails, and so does an accepted one that no longer fires."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.helm.conftest import EXAMPLE_VALUES, PIN_EVERY_IMAGE, pod_specs, render

SKIPS = Path(__file__).parent / "checkov-skips.yaml"


def scanned_objects(objects: list[dict]) -> list[dict]:
    """The rendered objects, plus what checkov cannot see inside them: the pods of the RayJob and
    of the SandboxTemplate (custom resources) as Pods, and the weight-sync Job kept as text in a
    ConfigMap."""
    extra = []
    for obj in objects:
        if obj["kind"] == "RayJob":
            cluster = obj["spec"]["rayClusterSpec"]
            groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
            templates = [g["template"] for g in groups] + [obj["spec"]["submitterPodTemplate"]]
            for (where, spec), template in zip(pod_specs(obj), templates, strict=True):
                name = where.split("/", 1)[1].replace("/", "-")
                metadata = {"name": name, "labels": template["metadata"]["labels"]}
                extra.append(
                    {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
                )
        elif obj["kind"] == "SandboxTemplate":
            # agent-sandbox's pods: scanned as the Pods the controller makes of the template.
            ((_, spec),) = pod_specs(obj)
            metadata = {"name": obj["metadata"]["name"],
                        "labels": obj["spec"]["podTemplate"]["metadata"]["labels"]}  # fmt: skip
            extra.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
        elif obj["kind"] == "ConfigMap" and "job.yaml" in obj.get("data", {}):
            job = yaml.safe_load(obj["data"]["job.yaml"])
            # Namespaced like the other rendered objects (Helm's), so policies match its pods.
            del job["metadata"]["namespace"]
            extra.append(job)
    return objects + extra


def run_checkov(directory: Path) -> dict:
    checkov = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "install-checkov.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # --skip-download: no call home (Prisma Cloud's guidelines), the scan is offline.
    scan = ["-d", str(directory), "--framework", "kubernetes", "--skip-download", "-o", "json"]
    result = subprocess.run(
        [checkov, *scan],
        capture_output=True,
        text=True,
        check=False,
    )
    # Exit 1 means findings; anything else (or no JSON) is checkov failing to run.
    assert result.returncode in (0, 1), result.stderr[-3000:]
    report = json.loads(result.stdout)
    return report[0] if isinstance(report, list) else report


@pytest.fixture(scope="module")
def findings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, str]]]:
    """Scanned once: values name -> [(check id, resource)] of every failed check."""
    directory = tmp_path_factory.mktemp("checkov")
    renders = {"default": render(), "digests": render(sets=PIN_EVERY_IMAGE)}
    renders.update({path.stem: render(path) for path in EXAMPLE_VALUES})
    for name, objects in renders.items():
        (directory / f"{name}.yaml").write_text(yaml.safe_dump_all(scanned_objects(objects)))
    report = run_checkov(directory)
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["passed"] > 400  # it really ran the Kubernetes checks
    found: dict[str, list[tuple[str, str]]] = {name: [] for name in renders}
    for check in report["results"]["failed_checks"]:
        found[Path(check["file_path"]).stem].append((check["check_id"], check["resource"]))
    return found


def accepted(check_id: str, resource: str, skips: dict) -> bool:
    skip = skips.get(check_id)
    return skip is not None and ("resources" not in skip or resource in skip["resources"])


def test_every_skip_has_a_reason() -> None:
    skips = yaml.safe_load(SKIPS.read_text())
    for check_id, skip in skips.items():
        assert check_id.startswith("CKV_K8S_"), check_id
        assert set(skip) <= {"reason", "resources"}, check_id
        assert len(skip["reason"]) > 20, check_id
    assert accepted("CKV_K8S_38", "Pod.default.clawrl-trainer-head", skips)
    assert not accepted("CKV_K8S_38", "Deployment.default.clawrl-gateway", skips)
    assert not accepted("CKV_K8S_22", "Deployment.default.clawrl-gateway", skips)


def test_checkov_finds_nothing_but_the_accepted(findings: dict) -> None:
    skips = yaml.safe_load(SKIPS.read_text())
    unexpected = [
        f"{values}: {check_id} {resource}"
        for values, failed in findings.items()
        for check_id, resource in failed
        if not accepted(check_id, resource, skips)
    ]
    assert not unexpected, "\n".join(unexpected)


def test_every_accepted_finding_still_fires(findings: dict) -> None:
    """Not stale: each skip (and each resource it names) matches a finding of today's chart."""
    skips = yaml.safe_load(SKIPS.read_text())
    fired = {item for failed in findings.values() for item in failed}
    for check_id, skip in skips.items():
        resources = skip.get("resources") or [r for c, r in fired if c == check_id][:1]
        assert resources, f"{check_id} no longer fires: remove it from {SKIPS.name}"
        for resource in resources:
            assert (check_id, resource) in fired, f"{check_id} no longer fires on {resource}"


def test_pinned_images_pass_the_digest_check(findings: dict) -> None:
    assert ("CKV_K8S_43", "Deployment.default.clawrl-gateway") in findings["default"]
    assert not [f for f in findings["digests"] if f[0] == "CKV_K8S_43"]
