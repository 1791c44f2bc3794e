"""The chart, checked by the real tools: `helm lint`, `helm template` with the default values and
every example values file, each rendered object validated against Kubernetes' own schemas (1.30
and the newest known) and the custom resources against their operators' CRD schemas."""

from __future__ import annotations

import copy
import functools
import os
import re
from collections.abc import Callable
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from clawrl.engine.settings import EngineSettings
from clawrl.gateway.settings import GatewaySettings
from clawrl.judge.settings import JudgeSettings
from clawrl.trainer.megatron.placement import plan_node
from clawrl.trainer.settings import TrainerSettings
from clawrl.trainer.weight_sync.settings import WeightSyncSettings
from tests.helm.conftest import (
    CHART,
    CLUSTER_VALUES,
    EXAMPLE_VALUES,
    crd_errors,
    helm,
    pod_specs,
    render,
)

KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CUSTOM = {("ray.io/v1", "RayJob"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
          ("monitoring.coreos.com/v1", "PrometheusRule"),
          ("extensions.agents.x-k8s.io/v1beta1", "SandboxTemplate"),
          ("extensions.agents.x-k8s.io/v1beta1", "SandboxWarmPool")}  # fmt: skip
VALUES_FILES = [None, *EXAMPLE_VALUES]


def values_id(path: Path | None) -> str:
    return "default" if path is None else path.name


@functools.cache
def objects_for(path: Path | None) -> list[dict]:
    """Rendered once per values file (tests copy before they change anything)."""
    files = () if path is None else (path,)
    return render(*files, sets=("serviceMonitor.enabled=true",))


def test_there_is_an_example_values_file() -> None:
    assert EXAMPLE_VALUES, "deploy/values-*.yaml: at least the multi-node example"


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), "-f", str(CLUSTER_VALUES)]
    args += [] if values is None else ["-f", str(values)]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_every_object_is_valid_kubernetes(values: Path | None) -> None:
    objects = objects_for(values)
    builtin = [o for o in objects if (o["apiVersion"], o["kind"]) not in CUSTOM]
    # The weight-sync Job lives as text in a ConfigMap: it must be a valid Job too.
    builtin += [
        yaml.safe_load(o["data"]["job.yaml"])
        for o in objects
        if o["kind"] == "ConfigMap" and "job.yaml" in o.get("data", {})
    ]
    errors = kubernetes_errors(builtin)
    assert not errors, "\n".join(errors)


def kubernetes_errors(objects: list[dict]) -> list[str]:
    """What Kubernetes' own schemas (each version of KUBERNETES_VERSIONS, strictly) reject."""
    errors = []
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{version} {obj['kind']}/{obj['metadata'].get('name')}: {exc}")
    return errors


def test_the_validator_rejects_an_unknown_field(default_objects: list[dict]) -> None:
    deployment = copy.deepcopy(next(o for o in default_objects if o["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["gpuCount"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30.0", strict=True)


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_custom_resources_match_their_operators_crds(
    values: Path | None, crd_schema: Callable[[str, str], dict]
) -> None:
    objects = objects_for(values)
    custom = [o for o in objects if (o["apiVersion"], o["kind"]) in CUSTOM]
    terminal = values is not None and values.name == "values-terminal.yaml"
    sandboxes = {"SandboxTemplate", "SandboxWarmPool"} if terminal else set()
    assert {o["kind"] for o in custom} == {"RayJob", "ServiceMonitor", "PrometheusRule", *sandboxes}
    for obj in custom:
        schema = crd_schema(obj["kind"], obj["apiVersion"].split("/")[1])
        assert not crd_errors(obj, schema), f"{obj['kind']}/{obj['metadata']['name']}"


def test_the_crd_check_rejects_a_misspelt_field(
    default_objects: list[dict], crd_schema: Callable[[str, str], dict]
) -> None:
    rayjob = copy.deepcopy(next(o for o in default_objects if o["kind"] == "RayJob"))
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 1
    assert crd_errors(rayjob, crd_schema("RayJob", "v1"))


def gpu_pods(objects: list[dict]) -> dict[str, tuple[int, dict, list]]:
    """GPU pods: name -> (GPUs of all its replicas, nodeSelector, tolerations)."""
    found = {}
    for obj in objects:
        for where, spec in pod_specs(obj):
            gpus = sum(
                int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
                for c in spec["containers"]
            )
            if not gpus:
                continue
            if obj["kind"] == "RayJob":
                group = obj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
                replicas = group["replicas"]
            else:
                replicas = obj["spec"].get("replicas", 1)
            found[where] = (gpus * replicas, spec.get("nodeSelector"), spec.get("tolerations"))
    return found


def test_default_gpus_are_4_2_2_on_one_node_selector(default_objects: list[dict]) -> None:
    pods = gpu_pods(default_objects)
    assert {where: gpus for where, (gpus, _, _) in pods.items()} == {
        "RayJob/clawrl-trainer/gpu": 4,
        "Deployment/clawrl-policy-engine": 2,
        "Deployment/clawrl-judge-engine": 2,
    }
    assert sum(gpus for gpus, _, _ in pods.values()) == 8
    selectors = {yaml.safe_dump(sel) for _, sel, _ in pods.values()}
    tolerations = {yaml.safe_dump(tol) for _, _, tol in pods.values()}
    assert len(selectors) == 1 and len(tolerations) == 1
    # The nvidia.com/gpu request alone picks GPU nodes: no label a cluster may lack is required.
    assert next(iter(pods.values()))[1] is None


def test_a_component_can_move_to_its_own_nodes() -> None:
    objects = render(sets=("judgeEngine.nodeSelector.pool=judge", "gpuNode.nodeSelector.gpu=a100"))
    pods = gpu_pods(objects)
    assert pods["Deployment/clawrl-judge-engine"][1] == {"pool": "judge"}
    assert pods["Deployment/clawrl-policy-engine"][1] == {"gpu": "a100"}


def effective(spec: dict, container: dict, key: str):
    return container.get("securityContext", {}).get(key, spec.get("securityContext", {}).get(key))


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_no_container_runs_as_root_or_privileged(values: Path | None) -> None:
    checked = 0
    for obj in objects_for(values):
        for where, spec in pod_specs(obj):
            for container in spec.get("initContainers", []) + spec["containers"]:
                name = f"{where}/{container['name']}"
                assert effective(spec, container, "runAsNonRoot") is True, name
                assert effective(spec, container, "runAsUser") not in (None, 0), name
                assert effective(spec, container, "privileged") is not True, name
                assert effective(spec, container, "allowPrivilegeEscalation") is False, name
                assert container.get("resources", {}).get("requests"), f"{name}: no requests"
                assert container["resources"].get("limits"), f"{name}: no limits"
                checked += 1
    assert checked >= 9  # gateway, 2 engines (+ fetches), judge, trainer x3, sync x2, redis


def test_every_object_has_the_standard_labels(default_objects: list[dict]) -> None:
    for obj in default_objects:
        labels = obj["metadata"].get("labels", {})
        for key in ("name", "instance", "component", "version", "managed-by", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels, f"{obj['kind']}/{obj['metadata']}"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("policyEngine.gpus=-1",), "/policyEngine/gpus"),
        (("trainer.workers.gpus=-4",), "/trainer/workers/gpus"),
        (("judge.mode=vibes",), "/judge/mode"),
        (("trainer.estimator=ppo2",), "/trainer/estimator"),
        (("redis.mode=cluster",), "/redis/mode"),
        (("models.policy.name=",), "/models/policy/name"),
        (("models.judge=null",), "models"),
        (("redis.mode=external",), "/redis/externalUrl"),
        (("gateway.replicaz=3",), "replicaz"),
        (("podSecurityContext.runAsNonRoot=false",), "runAsNonRoot"),
        (("gateway.image.digest=latest",), "/gateway/image/digest"),
        (("redis.image.digest=sha256:abc",), "/redis/image/digest"),
    ],
)
def test_the_schema_rejects_bad_values(sets: tuple[str, ...], message: str) -> None:
    result = helm("template", "clawrl", str(CHART), *[a for s in sets for a in ("--set", s)])
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_networkpolicies_keep_control_and_data_inside(default_objects: list[dict]) -> None:
    policies = {
        o["metadata"]["name"]: o["spec"] for o in default_objects if o["kind"] == "NetworkPolicy"
    }
    gateway = policies["clawrl-gateway"]["ingress"]
    # Serving: open to everyone (no `from`), port 30000 only.
    public = [rule for rule in gateway if "from" not in rule]
    assert [[p["port"] for p in rule["ports"]] for rule in public] == [[30000]]
    # Control: only the trainer and the weight-sync job.
    (control,) = [rule for rule in gateway if "from" in rule]
    assert [p["port"] for p in control["ports"]] == [30001]
    components = {
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for peer in control["from"]
    }
    assert components == {"trainer", "weight-sync"}
    redis, scrape = policies["clawrl-redis"]["ingress"]  # clients; the exporter's scrapers
    assert scrape["ports"] == [{"port": 9121}]
    assert [redis] == [
        {
            "from": [
                {
                    "podSelector": {
                        "matchLabels": {
                            "app.kubernetes.io/name": "clawrl",
                            "app.kubernetes.io/instance": "clawrl",
                        }
                    }
                }
            ],
            "ports": [{"port": 6379}],
        }
    ]
    # Every pod that serves something is covered by a policy.
    selected = {
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in policies.values()
    }
    assert selected >= {"gateway", "policy-engine", "judge-engine", "judge", "redis", "trainer"}


def test_the_weight_sync_template_and_cronjob_share_one_job_spec(
    default_objects: list[dict],
) -> None:
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in default_objects}
    template = yaml.safe_load(by_kind[("ConfigMap", "clawrl-weight-sync")]["data"]["job.yaml"])
    cronjob = by_kind[("CronJob", "clawrl-weight-sync")]
    assert cronjob["spec"]["suspend"] is True
    assert template["kind"] == "Job" and template["metadata"]["namespace"] == "ml"
    # One spec; by hand (the CronJob) `run` syncs the newest announced version, while the
    # launcher adds `run --version N --path P` to the template's container.
    manual = copy.deepcopy(cronjob["spec"]["jobTemplate"]["spec"])
    (manual_container,) = manual["template"]["spec"]["containers"]
    assert manual_container.pop("args") == ["run"]
    assert template["spec"] == manual
    assert "args" not in template["spec"]["template"]["spec"]["containers"][0]
    (rayjob,) = [o for o in default_objects if o["kind"] == "RayJob"]
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["template"]["spec"]["serviceAccountName"] == "clawrl-trainer"
    role = by_kind[("Role", "clawrl-trainer")]
    jobs = next(rule for rule in role["rules"] if rule["resources"] == ["jobs"])
    assert {"create", "get", "delete", "watch"} <= set(jobs["verbs"])
    status = next(rule for rule in role["rules"] if rule["resources"] == ["jobs/status"])
    assert "get" in status["verbs"]
    # The launcher runs next to the driver, under the trainer's account, with the template.
    containers = {c["name"]: c for c in head["template"]["spec"]["containers"]}
    launcher = containers["weight-sync-launcher"]
    assert launcher["command"][:2] == ["clawrl-weight-sync", "watch"]
    launcher_env = {e["name"]: e.get("value") for e in launcher["env"]}
    mount = next(m for m in launcher["volumeMounts"] if m["name"] == "weight-sync-template")
    assert launcher_env["CLAWRL_LAUNCHER__JOB_TEMPLATE"] == f"{mount['mountPath']}/job.yaml"
    # The job reaches every gateway and policy-engine replica through headless Services that
    # also list not-ready pods (a paused gateway is not ready).
    (sync,) = template["spec"]["template"]["spec"]["containers"]
    assert sync["name"] == "weight-sync"
    env = {e["name"]: e.get("value") for e in sync["env"]}
    for key, port in (("GATEWAYS", 30001), ("ENGINES", 30000)):
        service_name = env[f"CLAWRL_{key}__SERVICE"].removesuffix(".ml.svc")
        service = by_kind[("Service", service_name)]["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
        assert [p["port"] for p in service["ports"]] == [port] == [int(env[f"CLAWRL_{key}__PORT"])]


def test_settings_reach_containers_as_environment(default_objects: list[dict]) -> None:
    objects = render(sets=("gateway.settings.sessions.idle_timeout_s=30",))
    gateway = next(
        o
        for o in objects
        if o["metadata"]["name"] == "clawrl-gateway" and o["kind"] == "Deployment"
    )
    env = {
        e["name"]: e.get("value")
        for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["CLAWRL_SESSIONS__IDLE_TIMEOUT_S"] == "30"
    assert env["CLAWRL_SERVING__ENGINE_URL"] == "http://clawrl-policy-engine:30000"
    assert env["CLAWRL_REDIS__URL"] == "redis://clawrl-redis:6379/0"
    assert env["CLAWRL_LOGGING__FORMAT"] == "json"


def test_external_redis_replaces_the_statefulset() -> None:
    objects = render(sets=("redis.mode=external", "redis.externalUrl=redis://r.example:6379/2"))
    assert not [o for o in objects if o["kind"] == "StatefulSet"]
    urls = {
        e["value"]
        for o in objects
        for _, spec in pod_specs(o)
        for c in spec["containers"]
        for e in c.get("env", [])
        if e["name"] == "CLAWRL_REDIS__URL"
    }
    assert urls == {"redis://r.example:6379/2"}


def test_hand_written_yaml_passes_yamllint() -> None:
    config = YamlLintConfig(file=str(CHART.parents[1] / ".yamllint.yaml"))
    files = [
        CHART / "values.yaml",
        CHART / "Chart.yaml",
        *CHART.parents[1].glob("deploy/**/*.yaml"),
    ]
    problems = [
        f"{path.relative_to(CHART.parents[1])}:{p.line}: {p.message}"
        for path in files
        for p in linter.run(path.read_text(), config, str(path))
    ]
    assert not problems, "\n".join(problems)


SERVICE_SETTINGS = {
    ("Deployment", "clawrl-gateway", "gateway"): GatewaySettings,
    ("Deployment", "clawrl-policy-engine", "engine"): EngineSettings,
    ("Deployment", "clawrl-judge-engine", "engine"): EngineSettings,
    ("Deployment", "clawrl-judge", "judge"): JudgeSettings,
    ("RayJob", "clawrl-trainer/head", "ray-head"): TrainerSettings,
    ("RayJob", "clawrl-trainer/gpu", "ray-worker"): TrainerSettings,
    ("RayJob", "clawrl-trainer/head", "weight-sync-launcher"): WeightSyncSettings,
    ("Job", "clawrl-weight-sync-", "weight-sync"): WeightSyncSettings,
    ("CronJob", "clawrl-weight-sync", "weight-sync"): WeightSyncSettings,
}
MODEL_READERS = [key for key, cls in SERVICE_SETTINGS.items() if cls is not WeightSyncSettings]


def container_env(objects: list[dict], kind: str, where: str, container: str) -> dict[str, str]:
    for obj in objects:
        for name, spec in pod_specs(obj):
            if name == f"{kind}/{where}":
                (c,) = [c for c in spec["containers"] if c["name"] == container]
                return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    raise AssertionError(f"no {kind}/{where}/{container}")


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
@pytest.mark.parametrize(("kind", "where", "container"), list(SERVICE_SETTINGS), ids=str)
def test_each_service_builds_its_settings_from_the_rendered_environment(
    kind: str,
    where: str,
    container: str,
    values: Path | None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The chart's CLAWRL_* variables are what the real settings classes accept: a misspelt
    field fails validation, and a section the service does not have is caught here (the
    settings would ignore it)."""
    settings_cls = SERVICE_SETTINGS[(kind, where, container)]
    env = container_env(objects_for(values), kind, where, container)
    for name in [n for n in os.environ if n.startswith("CLAWRL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLAWRL_CONFIG", str(tmp_path / "none.toml"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sections = {n.removeprefix("CLAWRL_").split("__")[0].lower() for n in env if "__" in n}
    assert sections <= set(settings_cls.model_fields), sections - set(settings_cls.model_fields)
    settings = settings_cls()
    assert settings.logging.format == "json"


@pytest.mark.parametrize(("kind", "where", "container"), MODEL_READERS, ids=str)
def test_model_readers_get_the_model_on_the_volume(
    kind: str, where: str, container: str, default_objects: list[dict]
) -> None:
    env = container_env(default_objects, kind, where, container)
    assert env["CLAWRL_MODEL__PATH"] == "/models/Qwen3-4B-Instruct-2507"


def test_the_cpu_example_needs_no_gpu() -> None:
    (cpu,) = [path for path in EXAMPLE_VALUES if path.name == "values-cpu.yaml"]
    objects = objects_for(cpu)
    assert not gpu_pods(objects)
    engines = [o for o in objects if o["metadata"]["name"].endswith("-engine")]
    for engine in [o for o in engines if o["kind"] == "Deployment"]:
        (container,) = engine["spec"]["template"]["spec"]["containers"]
        assert container["args"][-2:] == ["--backend", "cpu"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["CLAWRL_ENGINE__BACKEND"] == "cpu"


# Values whose contents are data (Kubernetes objects, clawrl settings), not chart options.
DATA_KEYS = {"settings", "resources", "fetchResources", "nodeSelector", "labels", "kubeRayOperator",
             "podSecurityContext", "securityContext", "scrapeFrom", "tolerations", "affinity",
             "topologySpreadConstraints", "podAnnotations"}  # fmt: skip


def uncommented_keys(text: str) -> list[str]:
    """Keys of values.yaml with no comment on the line above (or at the end of their line)."""
    missing, parents, previous = [], [], ""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("#"):
            indent = len(line) - len(line.lstrip())
            while parents and parents[-1][0] >= indent:
                parents.pop()
            key = re.match(r"\s*(- )?([A-Za-z_][\w.-]*):", line)
            if key:
                in_data = any(name in DATA_KEYS or item for _, name, item in parents)
                commented = previous.lstrip().startswith("#") or " # " in line
                if not (key.group(1) or in_data or commented):
                    missing.append(f"{number}: {line.strip()}")
                parents.append((indent, key.group(2), bool(key.group(1))))
        previous = line
    return missing


def test_every_value_has_a_comment() -> None:
    assert not uncommented_keys((CHART / "values.yaml").read_text())
    assert uncommented_keys("a:\n  # -- b\n  b: 1\n  c: 2\n") == ["1: a:", "4: c: 2"]


def test_every_helper_has_a_comment() -> None:
    lines = (CHART / "templates" / "_helpers.tpl").read_text().splitlines()
    defines = [i for i, line in enumerate(lines) if line.startswith("{{- define ")]
    assert len(defines) >= 10
    assert [lines[i] for i in defines if not lines[i - 1].startswith("{{/*")] == []


def test_notes_tell_how_to_reach_the_gateway(default_objects: list[dict]) -> None:
    result = helm(
        "install", "clawrl", str(CHART), "--dry-run=client", "--namespace", "ml",
        "-f", str(CLUSTER_VALUES),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    service = next(
        o
        for o in default_objects
        if o["kind"] == "Service" and o["metadata"]["name"] == "clawrl-gateway"
    )
    port = service["spec"]["ports"][0]["port"]
    assert f"kubectl -n ml port-forward svc/clawrl-gateway 30000:{port}" in notes
    assert 'base_url="http://localhost:30000/v1"' in notes and "OpenClaw" in notes
    assert "create job --from=cronjob/clawrl-weight-sync" in notes


def test_the_default_layout_is_the_trainers_placement_plan(default_objects: list[dict]) -> None:
    """The chart's 4/2/2 defaults are the Megatron backend's plan for one 8-GPU node."""
    plan = plan_node()
    head = container_env(default_objects, "RayJob", "clawrl-trainer/head", "ray-head")
    assert head["CLAWRL_TRAIN__BACKEND"] == "megatron"
    assert int(head["CLAWRL_MEGATRON__TENSOR_PARALLEL_SIZE"]) == plan.trainer_tp
    assert head["CLAWRL_MEGATRON__PLACEMENT_STRATEGY"] == plan.trainer_strategy
    assert float(head["CLAWRL_RAY__ACTOR_NUM_GPUS"]) == plan.trainer_bundles[0]["GPU"]
    pods = gpu_pods(default_objects)
    assert pods["RayJob/clawrl-trainer/gpu"][0] == len(plan.trainer_bundles)
    for component, engine in (("policy-engine", plan.policy), ("judge-engine", plan.judge)):
        deployment = next(
            o
            for o in default_objects
            if o["kind"] == "Deployment" and o["metadata"]["name"] == f"clawrl-{component}"
        )
        env = container_env(default_objects, "Deployment", f"clawrl-{component}", "engine")
        assert deployment["spec"]["replicas"] == engine.replicas
        assert int(env["CLAWRL_SGLANG__TP_SIZE"]) == engine.tp
        assert pods[f"Deployment/clawrl-{component}"][0] == engine.gpus


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_rendered_manifests_have_no_whitespace_only_lines(values: Path | None) -> None:
    args = ["template", "clawrl", str(CHART), "-f", str(CLUSTER_VALUES)]
    args += [] if values is None else ["-f", str(values)]
    result = helm(*args, "--set", "serviceMonitor.enabled=true")
    assert result.returncode == 0, result.stderr
    blank = [n for n, line in enumerate(result.stdout.splitlines(), 1) if line and not line.strip()]
    assert not blank


def test_a_model_on_the_volume_is_not_downloaded() -> None:
    objects = render(sets=("models.policy.hubId=", "models.judge.hubId="))
    specs = [spec for obj in objects for _, spec in pod_specs(obj)]
    assert not [spec for spec in specs if spec.get("initContainers")]
    env = container_env(objects, "Deployment", "clawrl-policy-engine", "engine")
    assert env["CLAWRL_MODEL__PATH"] == "/models/Qwen3-4B-Instruct-2507"
    downloading = objects_for(None)
    fetches = [
        c["name"] for o in downloading for _, s in pod_specs(o) for c in s.get("initContainers", [])
    ]
    assert "fetch-model" in fetches and "fetch-judge-tokenizer" in fetches


@pytest.mark.parametrize(
    "where, container", [("clawrl-trainer/head", "ray-head"), ("clawrl-trainer/gpu", "ray-worker")]
)
def test_ray_runs_the_training_actors_at_normal_priority(
    where: str, container: str, default_objects: list[dict]
) -> None:
    """Ray's default niceness of 15 for worker processes starves the training actor of CPU
    beside anything else busy on the node (make run: trainer steps took minutes, not seconds)."""
    env = container_env(default_objects, "RayJob", where, container)
    assert env["RAY_worker_niceness"] == "0"
