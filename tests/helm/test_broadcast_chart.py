"""weightSync.transport nccl in the chart (issue 18, "the distributed path, wired"): the trainer
gets the gateways' and engines' addresses, the control token and the broadcast settings, builds
its real TrainerSettings from them, no launcher runs beside it, and the NetworkPolicies let
trainer -> gateway gRPC, trainer -> engine HTTP and the broadcast group's connections through
(both ways, Ray workers only), while disk syncs keep them shut."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clawrl.trainer.settings import TrainerSettings
from tests.helm.conftest import helm, render

NCCL = ("weightSync.transport=nccl", "gateway.controlTokenSecret=control-token")


def pod_templates(objects: list[dict]) -> dict[str, dict]:
    """Pod templates by role: trainer-head, trainer-worker, policy-engine, gateway."""
    (rayjob,) = [o for o in objects if o["kind"] == "RayJob"]
    cluster = rayjob["spec"]["rayClusterSpec"]
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    return {
        "trainer-head": cluster["headGroupSpec"]["template"],
        "trainer-worker": cluster["workerGroupSpecs"][0]["template"],
        "policy-engine": deployments["clawrl-policy-engine"]["spec"]["template"],
        "gateway": deployments["clawrl-gateway"]["spec"]["template"],
    }


def env_of(container: dict) -> dict[str, dict | str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def admits(objects: list[dict], source: dict, target: dict, port: int) -> bool:
    """Whether the release's NetworkPolicies let a pod with `source`'s labels reach `target`'s
    pod on `port` (a pod no policy selects is open; policies add up)."""
    src, dst = source["metadata"]["labels"], target["metadata"]["labels"]

    def matches(selector: dict, labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    policies = [o["spec"] for o in objects if o["kind"] == "NetworkPolicy"
                and matches(o["spec"]["podSelector"], dst)]  # fmt: skip
    if not policies:
        return True
    for policy in policies:
        for rule in policy.get("ingress", []):
            peers = rule.get("from")
            peer_ok = peers is None or any(
                "namespaceSelector" not in peer and matches(peer["podSelector"], src)
                for peer in peers
                if "podSelector" in peer
            )
            ports = [p["port"] for p in rule.get("ports", [])]
            if peer_ok and (not ports or port in ports):
                return True
    return False


@pytest.fixture(scope="module")
def nccl() -> list[dict]:
    return render(sets=NCCL)


@pytest.fixture(scope="module")
def disk() -> list[dict]:
    return render(sets=("gateway.controlTokenSecret=control-token",))


@pytest.mark.parametrize("role", ["trainer-head", "trainer-worker"])
def test_the_trainer_gets_the_sync_targets_and_token(nccl: list[dict], role: str) -> None:
    (container,) = pod_templates(nccl)[role]["spec"]["containers"][:1]
    env = env_of(container)
    assert env["CLAWRL_WEIGHT_SYNC__TRANSPORT"] == "nccl"
    assert env["CLAWRL_WEIGHT_SYNC__MASTER_PORT"] == "29600"
    assert env["CLAWRL_WEIGHT_SYNC__ENGINE_TP"] == "2"  # policyEngine.tensorParallel
    assert env["CLAWRL_GATEWAYS__SERVICE"] == "clawrl-gateway-control.ml.svc"
    assert env["CLAWRL_GATEWAYS__PORT"] == "30001"
    assert env["CLAWRL_ENGINES__SERVICE"] == "clawrl-policy-engine-replicas.ml.svc"
    assert env["CLAWRL_ENGINES__PORT"] == "30000"
    assert env["CLAWRL_GATEWAYS__TOKEN"] == {
        "secretKeyRef": {"name": "control-token", "key": "token"}
    }


def test_the_trainer_builds_its_settings_from_that_environment(
    nccl: list[dict], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (container,) = pod_templates(nccl)["trainer-worker"]["spec"]["containers"]
    for name in [n for n in os.environ if n.startswith("CLAWRL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLAWRL_CONFIG", str(tmp_path / "none.toml"))
    for name, value in env_of(container).items():
        monkeypatch.setenv(name, value if isinstance(value, str) else "from-a-secret")
    settings = TrainerSettings()  # validates nccl against the backend and the sync targets
    sync = settings.sync_job_settings()
    assert settings.weight_sync.transport == "nccl" and settings.weight_sync.master_port == 29600
    assert sync.gateways.service == "clawrl-gateway-control.ml.svc"
    assert sync.gateways.token.get_secret_value() == "from-a-secret"
    assert sync.engines.service == "clawrl-policy-engine-replicas.ml.svc"


def test_with_nccl_no_launcher_runs_beside_the_trainer(nccl: list[dict], disk: list[dict]) -> None:
    def head_containers(objects: list[dict]) -> list[str]:
        return [c["name"] for c in pod_templates(objects)["trainer-head"]["spec"]["containers"]]

    assert head_containers(disk) == ["ray-head", "weight-sync-launcher"]
    assert head_containers(nccl) == ["ray-head"]  # the trainer syncs; a launcher would too
    (service,) = [o for o in nccl if o["kind"] == "Service" and o["metadata"]["name"] ==
                  "clawrl-trainer"]  # fmt: skip
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
    head = pod_templates(disk)["trainer-head"]["spec"]["containers"][0]
    assert "CLAWRL_WEIGHT_SYNC__TRANSPORT" not in env_of(head)  # disk: the settings' default


def test_the_network_lets_the_broadcast_through_with_nccl_only(
    nccl: list[dict], disk: list[dict]
) -> None:
    for objects in (nccl, disk):
        pods = pod_templates(objects)
        # Pause and resume the gateways; the engines' HTTP API (init group, update, version).
        assert admits(objects, pods["trainer-head"], pods["gateway"], 30001)
        assert admits(objects, pods["trainer-worker"], pods["gateway"], 30001)
        assert admits(objects, pods["trainer-head"], pods["policy-engine"], 30000)
        # Never the Ray dashboard (it runs submitted jobs) from an engine.
        assert not admits(objects, pods["policy-engine"], pods["trainer-head"], 8265)
    pods = pod_templates(nccl)
    # The engines reach rank 0's rendezvous and NCCL's ephemeral sockets on the Ray workers,
    # and rank 0 reaches the engines' NCCL sockets.
    assert admits(nccl, pods["policy-engine"], pods["trainer-worker"], 29600)
    assert admits(nccl, pods["policy-engine"], pods["trainer-worker"], 43127)
    assert admits(nccl, pods["trainer-worker"], pods["policy-engine"], 43127)
    assert not admits(nccl, pods["policy-engine"], pods["trainer-head"], 29600)
    assert not admits(nccl, pods["gateway"], pods["trainer-worker"], 29600)
    pods = pod_templates(disk)
    assert not admits(disk, pods["policy-engine"], pods["trainer-worker"], 29600)
    assert not admits(disk, pods["trainer-worker"], pods["policy-engine"], 43127)


def test_nccl_needs_the_megatron_backend() -> None:
    chart = Path(__file__).parents[2] / "helm" / "clawrl"
    result = helm("template", "x", str(chart), "-f", str(Path(__file__).parent /
                  "cluster-values.yaml"), "--set", "weightSync.transport=nccl",
                  "--set", "trainer.backend=torch")  # fmt: skip
    assert result.returncode != 0 and "trainer.backend to megatron" in result.stderr
    result = helm("template", "x", str(chart), "--set", "weightSync.transport=broadcast")
    assert result.returncode != 0 and "transport" in result.stderr
