"""Track 2's objects in the chart, rendered by the real `helm`: the sandbox service
(environments), agent-sandbox's SandboxTemplate and SandboxWarmPool validated against
agent-sandbox's own CRD schemas (tests/helm/crds), the sandbox pods' hardening and their
NetworkPolicy, and the agent runner's Job. All of it is off by default."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest

from tests.helm.conftest import CHART, CLUSTER_VALUES, crd_errors, helm, pod_specs, render
from tests.helm.test_chart import CUSTOM, kubernetes_errors

ALL_ON = (
    "environments.enabled=true",
    "environments.sandbox.enabled=true",
    "environments.sandbox.warmPool.enabled=true",
    "agentRunner.enabled=true",
    "serviceMonitor.enabled=true",
)
TRACK2_COMPONENTS = {"environments", "sandbox", "agent-runner"}
SANDBOX_KINDS = {"SandboxTemplate", "SandboxWarmPool"}


@functools.cache
def rendered(*sets: str) -> list[dict]:
    return render(sets=sets)


def by_kind(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def component(obj: dict) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def sandbox_pod(objects: list[dict]) -> tuple[dict, dict]:
    """(pod template metadata, pod spec) of the SandboxTemplate."""
    template = by_kind(objects, "SandboxTemplate", "clawrl-sandbox")
    return template["spec"]["podTemplate"]["metadata"], template["spec"]["podTemplate"]["spec"]


def test_everything_is_off_by_default() -> None:
    objects = rendered()
    assert not [o for o in objects if o["kind"] in SANDBOX_KINDS]
    assert not [o["metadata"]["name"] for o in objects if component(o) in TRACK2_COMPONENTS]
    # Switched on, the same chart renders them: the check above can fail.
    kinds = {(o["kind"], component(o)) for o in rendered(*ALL_ON)}
    assert {("SandboxTemplate", "sandbox"), ("SandboxWarmPool", "sandbox")} <= kinds
    assert {("Deployment", "environments"), ("Job", "agent-runner")} <= kinds


def test_the_sandbox_resources_match_agent_sandboxs_crds(
    crd_schema: Callable[[str, str], dict],
) -> None:
    custom = [o for o in rendered(*ALL_ON) if o["kind"] in SANDBOX_KINDS]
    assert sorted(o["kind"] for o in custom) == ["SandboxTemplate", "SandboxWarmPool"]
    for obj in custom:
        assert (obj["apiVersion"], obj["kind"]) in CUSTOM
        group, version = obj["apiVersion"].split("/")
        assert group == "extensions.agents.x-k8s.io"
        assert crd_errors(obj, crd_schema(obj["kind"], version)) == [], obj["kind"]


@pytest.mark.parametrize(
    ("kind", "path", "field"),
    [
        # A misspelt hardening field inside the embedded pod spec (readOnlyRootFileSystem).
        ("SandboxTemplate", ("podTemplate", "spec", "containers", 0, "securityContext"),
         "readOnlyRootFileSystem"),
        ("SandboxTemplate", (), "networkPolicyManagment"),
        ("SandboxWarmPool", (), "size"),
    ],
)  # fmt: skip
def test_the_crd_check_rejects_a_misspelt_field(
    kind: str, path: tuple, field: str, crd_schema: Callable[[str, str], dict]
) -> None:
    obj = copy.deepcopy(by_kind(rendered(*ALL_ON), kind, "clawrl-sandbox"))
    node = obj["spec"]
    for key in path:
        node = node[key]
    node[field] = True
    errors = crd_errors(obj, crd_schema(kind, "v1beta1"))
    assert errors and field in errors[0], errors


def test_the_builtin_objects_are_valid_kubernetes() -> None:
    objects = [
        o
        for o in rendered(*ALL_ON)
        if component(o) in TRACK2_COMPONENTS and (o["apiVersion"], o["kind"]) not in CUSTOM
    ]
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
                            "NetworkPolicy", "NetworkPolicy", "NetworkPolicy", "Job",
                            "Service"])  # fmt: skip
    errors = kubernetes_errors(objects)
    assert not errors, "\n".join(errors)


def test_the_sandbox_pod_is_locked_down() -> None:
    template = by_kind(rendered(*ALL_ON), "SandboxTemplate", "clawrl-sandbox")["spec"]
    # agent-sandbox's own default policy would let sandboxes reach the internet.
    assert template["networkPolicyManagement"] == "Unmanaged"
    assert template["service"] is False
    assert template["envVarsInjectionPolicy"] == "Disallowed"
    assert template["volumeClaimTemplatesPolicy"] == "Disallowed"
    _, spec = sandbox_pod(rendered(*ALL_ON))
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert "runtimeClassName" not in spec  # gVisor only when asked for
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = spec["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["privileged"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    limits = container["resources"]["limits"]
    assert {"cpu", "memory", "ephemeral-storage"} <= limits.keys()
    # Writable: the workspace and /tmp only, both bounded emptyDirs.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert set(mounts) == {"/workspace", "/tmp"}
    assert all(v["emptyDir"]["sizeLimit"] == "512Mi" for v in mounts.values())
    assert container["workingDir"] == "/workspace"


def test_gvisor_and_the_pool_size_come_from_values() -> None:
    objects = render(
        sets=(
            *ALL_ON,
            "environments.sandbox.runtimeClassName=gvisor",
            "environments.sandbox.warmPool.size=3",
        )
    )
    assert sandbox_pod(objects)[1]["runtimeClassName"] == "gvisor"
    pool = by_kind(objects, "SandboxWarmPool", "clawrl-sandbox")["spec"]
    assert pool["replicas"] == 3
    assert pool["sandboxTemplateRef"] == {"name": "clawrl-sandbox"}
    by_kind(objects, "SandboxTemplate", pool["sandboxTemplateRef"]["name"])


def matches(selector: dict, labels: dict) -> bool:
    """A NetworkPolicy label selector (matchLabels only, as the chart writes them)."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_sandbox_pods_get_no_network() -> None:
    objects = rendered(*ALL_ON)
    metadata, _ = sandbox_pod(objects)
    labels = metadata["labels"]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    (own,) = [p for p in policies if matches(p["spec"]["podSelector"], labels)]
    assert own["metadata"]["name"] == "clawrl-sandbox"
    assert sorted(own["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    assert own["spec"]["egress"] == [] and own["spec"]["ingress"] == []
    # No other policy lets a sandbox in anywhere: the release's pods are admitted to Redis and
    # to the sandbox service by their labels, which sandbox pods do not carry.
    admitting = [
        p["metadata"]["name"]
        for p in policies
        for rule in p["spec"].get("ingress", [])
        for peer in rule.get("from", [])
        if "podSelector" in peer
        and "namespaceSelector" not in peer
        and matches(peer["podSelector"], labels)
    ]
    assert admitting == []
    redis = by_kind(objects, "NetworkPolicy", "clawrl-redis")["spec"]["ingress"][0]["from"][0]
    release_pod = {**labels, "app.kubernetes.io/name": "clawrl"}
    assert matches(redis["podSelector"], release_pod)  # the check above can fail


def test_the_sandbox_network_policy_is_not_optional() -> None:
    """networkPolicy.enabled=false turns off the release's policies, never the sandboxes'."""
    objects = render(
        sets=(*ALL_ON, "networkPolicy.enabled=false", "gateway.controlTokenSecret=control")
    )
    names = [o["metadata"]["name"] for o in objects if o["kind"] == "NetworkPolicy"]
    assert names == ["clawrl-sandbox"]


def test_the_sandbox_service_may_claim_and_exec_and_nothing_more() -> None:
    objects = rendered(*ALL_ON)
    deployment = by_kind(objects, "Deployment", "clawrl-environments")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is True
    binding = by_kind(objects, "RoleBinding", "clawrl-environments")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": "ml"}
    ]
    by_kind(objects, "ServiceAccount", spec["serviceAccountName"])
    rules = by_kind(objects, "Role", binding["roleRef"]["name"])["rules"]
    granted = {
        (group, resource): set(rule["verbs"])
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert granted == {
        ("extensions.agents.x-k8s.io", "sandboxclaims"): {
            "create", "get", "list", "watch", "patch", "delete",
        },
        ("agents.x-k8s.io", "sandboxes"): {"get"},
        ("", "pods"): {"get"},
        ("", "pods/exec"): {"create", "get"},
    }  # fmt: skip
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    pool = by_kind(objects, "SandboxWarmPool", "clawrl-sandbox")
    assert env["CLAWRL_KUBE_SANDBOX__WARM_POOL"] == pool["metadata"]["name"]
    assert env["CLAWRL_KUBE_SANDBOX__NAMESPACE"] == "ml"
    assert env["CLAWRL_LEASES__BACKEND"] == "kubernetes"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    service = by_kind(objects, "Service", "clawrl-environments")["spec"]
    assert {p["name"]: p["port"] for p in service["ports"]} == ports == {"http": 30040}
    assert int(env["CLAWRL_ENVIRONMENTS_SERVER__PORT"]) == ports["http"]
    assert env["CLAWRL_ENVIRONMENTS_SERVER__HOST"] == "0.0.0.0"
    monitor = by_kind(objects, "ServiceMonitor", "clawrl-environments")
    endpoints = [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]]
    assert endpoints == [("http", "/metrics")]


def test_the_local_backend_needs_no_api_access() -> None:
    objects = render(
        sets=(
            "environments.enabled=true",
            "environments.backend=local",
            "environments.seccompProfile.type=Localhost",
            "environments.seccompProfile.localhostProfile=profiles/bwrap.json",
        )
    )
    kinds = {o["kind"] for o in objects if component(o) == "environments"}
    assert kinds == {"Deployment", "Service", "NetworkPolicy"}
    spec = by_kind(objects, "Deployment", "clawrl-environments")["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in spec
    assert spec["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": "profiles/bwrap.json",
    }
    assert spec["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["CLAWRL_LEASES__BACKEND"] == "local"
    assert not [name for name in env if name.startswith("CLAWRL_KUBE_SANDBOX__")]


def test_the_runner_plays_through_the_gateway_and_the_sandbox_service() -> None:
    objects = render(
        sets=(
            *ALL_ON,
            "agentRunner.split=held_out",
            "agentRunner.episodes=40",
            "agentRunner.apiKeySecret=runner-key",
            "agentRunner.extraArgs={--task-set,terminal}",
            "gateway.service.port=8080",
        )
    )
    job = by_kind(objects, "Job", "clawrl-agent-runner")
    ((_, spec),) = pod_specs(job)
    assert spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert container["command"] == ["clawrl", "agent", "run"]
    args = container["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags == {
        "--gateway-url": "http://clawrl-gateway:8080/v1",
        "--environments-url": "http://clawrl-environments:30040",
        "--split": "held_out",
        "--episodes": "40",
        "--concurrency": "4",
        "--metrics-port": "30041",
        "--out": "/tmp/agent/episodes.jsonl",
        "--eval-dir": "/tmp/agent",
        "--task-set": "terminal",
    }
    gateway = by_kind(objects, "Service", "clawrl-gateway")["spec"]["ports"]
    assert 8080 in [p["port"] for p in gateway]
    (key,) = [e for e in container["env"] if e["name"] == "OPENAI_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "runner-key", "key": "api-key"}
    # Nothing connects to the runner but the scrapers, to its metrics port.
    policy = by_kind(objects, "NetworkPolicy", "clawrl-agent-runner")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert [rule["ports"] for rule in policy["ingress"]] == [[{"port": 30041}]]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("environments.enabled=true",), "claims sandboxes from a warm pool"),
        (("environments.sandbox.warmPool.enabled=true",), "needs environments.sandbox.enabled"),
        (("agentRunner.enabled=true",), "needs gateway.enabled and environments.enabled"),
        (("environments.backend=docker",), "/environments/backend"),
        (("environments.sandbox.warmPool.size=-1",), "/environments/sandbox/warmPool/size"),
        (("agentRunner.split=test",), "/agentRunner/split"),
        (("environments.sandbox.resources.limits=null",), "limits"),
    ],
)
def test_bad_values_fail_with_a_clear_message(sets: tuple[str, ...], message: str) -> None:
    args = ["template", "clawrl", str(CHART), "-f", str(CLUSTER_VALUES)]
    result = helm(*args, *[a for s in sets for a in ("--set", s)])
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_an_existing_pool_may_stand_in_for_the_charts() -> None:
    objects = render(
        sets=("environments.enabled=true", "environments.settings.kube_sandbox.warm_pool=mine")
    )
    assert not [o for o in objects if o["kind"] in SANDBOX_KINDS]
    spec = by_kind(objects, "Deployment", "clawrl-environments")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["CLAWRL_KUBE_SANDBOX__WARM_POOL"] == "mine"
