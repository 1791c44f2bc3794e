"""The chart rendered by the real `helm` binary (scripts/install-helm.py puts it in the cache
directory), as parsed objects, plus the upstream CRD schemas the custom resources must satisfy."""

from __future__ import annotations

import copy
import gzip
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.conftest import REPO

CHART = REPO / "helm" / "clawrl"
EXAMPLE_VALUES = sorted((REPO / "deploy").glob("values-*.yaml"))
CRDS = Path(__file__).parent / "crds"
# The storage class a cluster must name (the chart refuses to guess one): rendered before any
# other values file.
CLUSTER_VALUES = Path(__file__).parent / "cluster-values.yaml"
# `--set`s pinning every image of the chart by one (made-up) digest.
DIGEST = "sha256:" + "ab" * 32
PIN_EVERY_IMAGE = tuple(
    f"{component}.image.digest={DIGEST}"
    for component in (
        "gateway", "policyEngine", "judgeEngine", "judge", "trainer", "weightSync", "redis",
        "redis.exporter",
    )
)  # fmt: skip


def helm_binary() -> str:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    for candidate in (cache / "clawrl" / "bin" / "helm", shutil.which("helm")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("helm is not installed: run `python scripts/install-helm.py` (make setup does)")


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, check=False)


def render(*values_files: Path, sets: tuple[str, ...] = ()) -> list[dict]:
    """`helm template` of the chart (CLUSTER_VALUES, then `values_files`) as a list of objects;
    fails the test when helm does."""
    args = ["template", "clawrl", str(CHART), "--namespace", "ml", "-f", str(CLUSTER_VALUES)]
    for path in values_files:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.load_all(result.stdout, Loader=yaml.CSafeLoader) if doc]


@pytest.fixture(scope="session")
def default_objects() -> list[dict]:
    """The chart with its default values, ServiceMonitors switched on."""
    return render(sets=("serviceMonitor.enabled=true",))


@pytest.fixture
def settings_of(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`settings_of(cls, env)`: the real settings class built from exactly that environment."""

    def build(cls, env: dict[str, str]):
        for name in [n for n in os.environ if n.startswith("CLAWRL_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("CLAWRL_CONFIG", str(tmp_path / "none.toml"))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return cls()

    return build


@pytest.fixture(scope="session")
def promtool() -> str:
    """Prometheus's own rule checker and tester."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: make setup installs Debian's prometheus, which has it")
    return path


def crd_schemas(pattern: str = "*.yaml.gz") -> dict[tuple[str, str], dict]:
    """(kind, version) -> openAPIV3Schema of the upstream CRDs kept in crds/."""
    schemas = {}
    for path in CRDS.glob(pattern):
        # libyaml's loader: the RayJob CRD is 1.4 MB of YAML (30 s with the pure-Python one).
        crd = yaml.load(gzip.decompress(path.read_bytes()), Loader=yaml.CSafeLoader)
        for version in crd["spec"]["versions"]:
            schemas[(crd["spec"]["names"]["kind"], version["name"])] = version["schema"][
                "openAPIV3Schema"
            ]
    return schemas


@pytest.fixture(scope="session")
def crd_schema() -> Callable[[str, str], dict]:
    """`crd_schema(kind, version)`: the openAPIV3Schema of an upstream CRD kept in crds/."""
    schemas = crd_schemas()
    return lambda kind, version: schemas[(kind, version)]


def strict(schema: dict) -> dict:
    """A CRD schema that also rejects unknown fields, as the API server's strict field
    validation does (objects keep unknown fields only where the CRD preserves them)."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
                and "additionalProperties" not in node
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_errors(obj: dict, schema: dict) -> list[str]:
    """Where obj breaks a CRD schema (strictly), as `path: message` lines; [] when valid."""
    validator = jsonschema.Draft7Validator(strict(schema))
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]


def pod_specs(obj: dict) -> Iterator[tuple[str, dict]]:
    """Every pod spec an object creates, with a name saying where it sits."""
    kind = obj["kind"]
    name = obj["metadata"].get("name") or obj["metadata"]["generateName"]
    spec = obj.get("spec", {})
    if kind == "Pod":  # the `helm test` hook
        yield f"{kind}/{name}", spec
    elif kind in ("Deployment", "StatefulSet", "Job"):
        yield f"{kind}/{name}", spec["template"]["spec"]
    elif kind == "CronJob":
        yield f"{kind}/{name}", spec["jobTemplate"]["spec"]["template"]["spec"]
    elif kind == "RayJob":
        # Named without the spec checksum that ends the RayJob's name: stable across renders.
        name = name.rsplit("-", 1)[0]
        cluster = spec["rayClusterSpec"]
        yield f"{kind}/{name}/head", cluster["headGroupSpec"]["template"]["spec"]
        for group in cluster.get("workerGroupSpecs", []):
            yield f"{kind}/{name}/{group['groupName']}", group["template"]["spec"]
        if "submitterPodTemplate" in spec:
            yield f"{kind}/{name}/submitter", spec["submitterPodTemplate"]["spec"]
    elif kind == "SandboxTemplate":  # agent-sandbox starts each sandbox's pod from it
        yield f"{kind}/{name}", spec["podTemplate"]["spec"]
    elif kind == "ConfigMap" and "job.yaml" in obj.get("data", {}):
        yield from pod_specs(yaml.safe_load(obj["data"]["job.yaml"]))
