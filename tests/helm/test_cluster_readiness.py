"""Issue 22: what a first `helm install` on a real GPU cluster (EKS, GKE, AKS) needs from the
chart: storage it can actually bind, scheduling that does not pin pods to labels a cluster may
lack, a RayJob KubeRay can run and upgrade, single scrapes, disruption budgets and volume
permissions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.helm.conftest import CHART, CLUSTER_VALUES, EXAMPLE_VALUES, helm, pod_specs, render

# Pod specs (pod_specs' names) by the values section that places them.
PODS_OF = {
    "gateway": ["Deployment/clawrl-gateway", "Pod/clawrl-helm-test"],
    "policyEngine": ["Deployment/clawrl-policy-engine"],
    "judgeEngine": ["Deployment/clawrl-judge-engine"],
    "judge": ["Deployment/clawrl-judge"],
    "redis": ["StatefulSet/clawrl-redis"],
    "weightSync": ["CronJob/clawrl-weight-sync", "Job/clawrl-weight-sync-"],
    "trainer.head": ["RayJob/clawrl-trainer/head", "RayJob/clawrl-trainer/submitter"],
    "trainer.workers": ["RayJob/clawrl-trainer/gpu"],
}


def pods(objects: list[dict]) -> dict[str, dict]:
    return {where: spec for obj in objects for where, spec in pod_specs(obj)}


def pod_templates(objects: list[dict]) -> dict[str, dict]:
    """Pod template metadata (labels, annotations) by pod_specs' names."""
    found = {}
    for obj in objects:
        if obj["kind"] == "ConfigMap" and "job.yaml" in obj.get("data", {}):
            obj = yaml.safe_load(obj["data"]["job.yaml"])
        spec = obj.get("spec", {})
        name = obj["metadata"].get("name") or obj["metadata"]["generateName"]
        kind = obj["kind"]
        if kind == "Pod":  # the `helm test` hook
            found[f"{kind}/{name}"] = obj["metadata"]
        elif kind in ("Deployment", "StatefulSet", "Job"):
            found[f"{kind}/{name}"] = spec["template"]["metadata"]
        elif kind == "CronJob":
            found[f"{kind}/{name}"] = spec["jobTemplate"]["spec"]["template"]["metadata"]
        elif kind == "RayJob":
            where = next(w for w, _ in pod_specs(obj)).rsplit("/", 1)[0]
            cluster = spec["rayClusterSpec"]
            found[f"{where}/head"] = cluster["headGroupSpec"]["template"]["metadata"]
            for group in cluster["workerGroupSpecs"]:
                found[f"{where}/{group['groupName']}"] = group["template"]["metadata"]
            found[f"{where}/submitter"] = spec["submitterPodTemplate"]["metadata"]
    return found


def values_file(tmp_path: Path, values: dict) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def template(*args: str) -> tuple[int, str, str]:
    result = helm("template", "clawrl", str(CHART), "--namespace", "ml", *args)
    return result.returncode, result.stdout, result.stderr


# 1. Storage ----------------------------------------------------------------------------------


@pytest.mark.parametrize("volume", ["checkpoints", "models"])
def test_a_shared_volume_without_a_class_or_claim_fails_at_render(volume: str) -> None:
    """The clouds' default classes (gp2/gp3, pd-balanced, managed-csi) cannot bind ReadWriteMany:
    the claim would stay Pending and every pod with it."""
    other = "models" if volume == "checkpoints" else "checkpoints"
    code, _, stderr = template("--set", f"volumes.{other}.storageClass=efs")
    assert code != 0
    assert f"volumes.{volume}: set storageClass" in stderr and "existingClaim" in stderr, stderr


def test_a_storage_class_or_an_existing_claim_is_enough() -> None:
    objects = render(sets=("volumes.models.existingClaim=my-models",
                           "volumes.checkpoints.storageClass=filestore-rwx"))  # fmt: skip
    claims = {
        o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "PersistentVolumeClaim"
    }
    assert claims["clawrl-checkpoints"]["storageClassName"] == "filestore-rwx"
    assert claims["clawrl-checkpoints"]["accessModes"] == ["ReadWriteMany"]
    assert "clawrl-models" not in claims
    volumes = {v["name"]: v for v in pods(objects)["Deployment/clawrl-policy-engine"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "my-models"
    code, _, stderr = template("--set", "volumes.models.existingClaim=m",
                               "--set", "volumes.checkpoints.existingClaim=c",
                               "--set", "gateway.allowOpenAccess=true")  # fmt: skip
    assert code == 0, stderr


def test_a_one_node_cluster_may_use_read_write_once_and_its_default_class() -> None:
    (cpu,) = [path for path in EXAMPLE_VALUES if path.name == "values-cpu.yaml"]
    code, stdout, stderr = template("-f", str(cpu))
    assert code == 0, stderr
    claims = [
        o["spec"] for o in yaml.safe_load_all(stdout) if o and o["kind"] == "PersistentVolumeClaim"
    ]
    assert [c["accessModes"] for c in claims] == [["ReadWriteOnce"]] * 2
    assert not [c for c in claims if "storageClassName" in c]


def test_notes_name_the_shared_volumes_storage() -> None:
    result = helm("install", "clawrl", str(CHART), "--dry-run=client", "-f", str(CLUSTER_VALUES))
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "checkpoints: ReadWriteMany from class test-rwx" in notes
    assert "models: ReadWriteMany from class test-rwx" in notes and "Pending" in notes


# 2. GPU scheduling ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values", [None, *EXAMPLE_VALUES], ids=lambda p: p.name if p else "default"
)
def test_no_pod_needs_a_node_label_the_values_do_not_name(values: Path | None) -> None:
    """The GPU request picks GPU nodes; nvidia.com/gpu.present exists only with NVIDIA's feature
    discovery, and `gpuNode.nodeSelector: {}` could not clear a default Helm merges into."""
    objects = render(*(() if values is None else (values,)))
    named = set()
    if values is not None:
        loaded = yaml.safe_load(values.read_text())
        named |= set((loaded.get("gpuNode", {}).get("nodeSelector") or {}).items())
        named |= set(loaded.get("trainer", {}).get("workers", {}).get("nodeSelector", {}).items())
    for where, spec in pods(objects).items():
        assert set((spec.get("nodeSelector") or {}).items()) <= named, where


SCHEDULING = {
    "runtimeClassName": "nvidia",
    "priorityClassName": "clawrl-high",
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}
            ]
        }
    },
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
        }
    ],
    "podAnnotations": {"example.com/team": "rl"},
}


@pytest.mark.parametrize("section", list(PODS_OF))
def test_scheduling_values_reach_the_components_pods(section: str, tmp_path: Path) -> None:
    values: dict = {}
    node = values
    for key in section.split("."):
        node = node.setdefault(key, {})
    node.update({key: f"{value}-{section.replace('.', '-').lower()}" if isinstance(value, str)
                 else value for key, value in SCHEDULING.items()})  # fmt: skip
    objects = render(values_file(tmp_path, values))
    specs, metadata = pods(objects), pod_templates(objects)
    suffix = section.replace(".", "-").lower()
    for where, spec in specs.items():
        mine = where in PODS_OF[section]
        assert (spec.get("runtimeClassName") == f"nvidia-{suffix}") is mine, where
        assert (spec.get("priorityClassName") == f"clawrl-high-{suffix}") is mine, where
        assert (spec.get("affinity") == SCHEDULING["affinity"]) is mine, where
        spread = spec.get("topologySpreadConstraints")
        assert (spread == SCHEDULING["topologySpreadConstraints"]) is mine, where
        annotations = metadata[where].get("annotations") or {}
        assert (annotations.get("example.com/team") == "rl") is mine, where


def test_gpu_pods_share_gpu_nodes_runtime_class() -> None:
    specs = pods(render(sets=("gpuNode.runtimeClassName=nvidia",
                              "judgeEngine.runtimeClassName=kata-nvidia")))  # fmt: skip
    classes = {where: spec.get("runtimeClassName") for where, spec in specs.items()}
    assert classes["Deployment/clawrl-policy-engine"] == "nvidia"
    assert classes["RayJob/clawrl-trainer/gpu"] == "nvidia"
    assert classes["Deployment/clawrl-judge-engine"] == "kata-nvidia"
    assert classes["Deployment/clawrl-gateway"] is None


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("gateway.affinity.nodeAfinity.x=1",), "nodeAfinity"),
        (("judge.priorityClassName=High Priority",), "/judge/priorityClassName"),
        (("trainer.workers.topologySpreadConstraints[0].maxSkew=1",), "topologyKey"),
        (("redis.podAnnotations.a=null",), "/redis/podAnnotations"),
        (("volumes.models.accessMode=ReadOnlyMany",), "/volumes/models/accessMode"),
    ],
)
def test_the_schema_rejects_bad_scheduling_values(sets: tuple[str, ...], message: str) -> None:
    code, _, stderr = template("-f", str(CLUSTER_VALUES), *[a for s in sets for a in ("--set", s)])
    assert code != 0
    assert message in stderr, stderr


# 3. KubeRay ----------------------------------------------------------------------------------


def rayjob(objects: list[dict]) -> dict:
    (job,) = [o for o in objects if o["kind"] == "RayJob"]
    return job


def test_the_kuberay_operator_may_poll_the_heads_dashboard(default_objects: list[dict]) -> None:
    """KubeRay asks the head's dashboard (8265) for the job's status; refused, it marks the
    RayJob Failed."""
    (policy,) = [
        o for o in default_objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "clawrl-trainer"
    ]  # fmt: skip
    operator = [
        rule for rule in policy["spec"]["ingress"]
        if any(peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name")
               == "kuberay-operator" and "namespaceSelector" in peer for peer in rule["from"])
    ]  # fmt: skip
    assert [[p["port"] for p in rule["ports"]] for rule in operator] == [[8265]]
    off = render(sets=("networkPolicy.kubeRayOperator=null",))
    (policy,) = [
        o for o in off if o["kind"] == "NetworkPolicy" and "trainer" in o["metadata"]["name"]
    ]
    assert not [
        r for r in policy["spec"]["ingress"] if 8265 in [p["port"] for p in r.get("ports", [])]
    ]


def test_a_stopped_trainer_is_retried_and_its_cluster_freed(default_objects: list[dict]) -> None:
    spec = rayjob(default_objects)["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["backoffLimit"] == 3 and spec["ttlSecondsAfterFinished"] == 600
    spec = rayjob(render(sets=("trainer.backoffLimit=0", "trainer.ttlSecondsAfterFinished=60")))
    assert (spec["spec"]["backoffLimit"], spec["spec"]["ttlSecondsAfterFinished"]) == (0, 60)


def test_the_fields_used_exist_in_kuberays_crd(default_objects, crd_schema) -> None:
    """The chart's RayJob fields are in KubeRay's v1 CRD (tests/helm/crds: v1.7.0); backoffLimit
    needs KubeRay 1.2 or newer, which NOTES asks for."""
    fields = crd_schema("RayJob", "v1")["properties"]["spec"]["properties"]
    spec = rayjob(default_objects)["spec"]
    assert set(spec) <= set(fields)
    for field in ("shutdownAfterJobFinishes", "backoffLimit", "ttlSecondsAfterFinished"):
        assert field in spec and field in fields


def test_an_upgrade_that_changes_the_trainer_is_a_new_rayjob(default_objects) -> None:
    """KubeRay disregards spec changes of a running RayJob: the name carries the spec's checksum,
    so `helm upgrade` replaces it (and leaves it alone when nothing of it changed)."""
    name = rayjob(default_objects)["metadata"]["name"]
    assert name.startswith("clawrl-trainer-") and len(name) == len("clawrl-trainer-") + 8
    changed = rayjob(render(sets=("serviceMonitor.enabled=true", "trainer.settings.ppo.lr=1e-6")))
    image = rayjob(render(sets=("serviceMonitor.enabled=true", "trainer.image.tag=0.2.0")))
    other = rayjob(render(sets=("serviceMonitor.enabled=true", "gateway.replicas=5")))
    assert changed["metadata"]["name"] != name and image["metadata"]["name"] != name
    assert other["metadata"]["name"] == name


def test_generated_names_stay_under_kuberays_limit() -> None:
    """KubeRay refuses a RayJob named over 47 characters; a release name may have 53."""
    release = "a-very-long-release-name-for-the-online-rl-trainer-x"
    result = helm("template", release, str(CHART), "-f", str(CLUSTER_VALUES))
    assert result.returncode == 0, result.stderr
    (job,) = [o for o in yaml.safe_load_all(result.stdout) if o and o["kind"] == "RayJob"]
    name = job["metadata"]["name"]
    assert len(name) <= 47 and name.startswith(release[:30]), name
    assert len(f"{release}-clawrl-trainer") > 47  # the test means something


def test_a_release_name_kuberay_cannot_take_fails_at_render() -> None:
    """KubeRay names the RayJob's cluster and Services after it: DNS-1035, a letter first."""
    result = helm("template", "2026-run", str(CHART), "-f", str(CLUSTER_VALUES))
    assert result.returncode != 0 and "start with a letter" in result.stderr
    fixed = helm("template", "2026-run", str(CHART), "-f", str(CLUSTER_VALUES),
                 "--set", "fullnameOverride=run-2026")  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr
    assert "name: run-2026-trainer-" in fixed.stdout


def test_ray_counts_cpus_explicitly(default_objects: list[dict]) -> None:
    """Without a CPU limit Ray would count every CPU of the node; the head does no Ray work."""
    cluster = rayjob(default_objects)["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] == "16"
    milli = rayjob(render(sets=("trainer.workers.resources.requests.cpu=2500m",)))
    assert (
        milli["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] == "2"
    )


def test_rays_own_metrics_port_is_kept(default_objects: list[dict]) -> None:
    """KubeRay adds its metrics port (8080, named metrics) only when no port has that name."""
    cluster = rayjob(default_objects)["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["metrics"] == 8080 and ports["trainer-metrics"] == 30030
    assert cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "8080"
    (service,) = [
        o
        for o in default_objects
        if o["kind"] == "Service" and o["metadata"]["name"] == "clawrl-trainer"
    ]
    targets = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert ports[targets["metrics"]] == 30030
    (policy,) = [
        o for o in default_objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "clawrl-trainer"
    ]  # fmt: skip
    scraped = [p["port"] for r in policy["spec"]["ingress"] if "ports" in r for p in r["ports"]]
    assert 8080 in scraped


# 4. Monitoring -------------------------------------------------------------------------------


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes LabelSelector (matchLabels and matchExpressions) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        if operator == "In" and labels.get(key) not in expression["values"]:
            return False
        if operator == "NotIn" and labels.get(key) in expression["values"]:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def test_each_service_monitor_scrapes_one_service(default_objects: list[dict]) -> None:
    """The policy engine's headless -replicas Service has the same pods: selecting it too would
    scrape every series twice."""
    services = [o for o in default_objects if o["kind"] == "Service"]
    monitors = [o for o in default_objects if o["kind"] == "ServiceMonitor"]
    assert len(monitors) >= 5
    for monitor in monitors:
        ports = {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]}
        chosen = [
            s["metadata"]["name"] for s in services
            if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
            and ports & {p["name"] for p in s["spec"]["ports"]}
        ]  # fmt: skip
        assert chosen == [monitor["metadata"]["name"]], monitor["metadata"]["name"]
    assert selects({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"b": "1"})
    assert not selects({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": ""})


# 6. Availability -----------------------------------------------------------------------------


def budgets(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "PodDisruptionBudget"}


def test_a_drain_takes_one_gateway_or_judge_replica_at_a_time(default_objects) -> None:
    found = budgets(default_objects)
    assert set(found) == {"clawrl-gateway", "clawrl-judge"}
    deployments = {o["metadata"]["name"]: o for o in default_objects if o["kind"] == "Deployment"}
    for name, spec in found.items():
        assert spec["maxUnavailable"] == 1
        assert spec["selector"] == deployments[name]["spec"]["selector"]
    assert not budgets(render(sets=("gateway.replicas=1", "judge.replicas=1")))
    scaled = render(sets=("gateway.replicas=1", "gateway.autoscaling.enabled=true"))
    assert "clawrl-gateway" in budgets(scaled)


def test_autoscalers_leave_the_trainer_alone(default_objects: list[dict]) -> None:
    metadata = pod_templates(default_objects)
    for where in PODS_OF["trainer.head"] + PODS_OF["trainer.workers"]:
        annotations = metadata[where]["annotations"]
        assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false", where
        assert annotations["karpenter.sh/do-not-disrupt"] == "true", where


def engine_strategy(objects: list[dict], name: str) -> dict:
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name
    ]
    return deployment["spec"]["strategy"]


def test_several_policy_engines_roll_one_at_a_time_without_surging(default_objects) -> None:
    assert engine_strategy(default_objects, "clawrl-policy-engine") == {"type": "Recreate"}
    strategy = engine_strategy(render(sets=("policyEngine.replicas=3",)), "clawrl-policy-engine")
    assert strategy == {"type": "RollingUpdate",
                        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}  # fmt: skip


# 7. Volumes ----------------------------------------------------------------------------------


def test_volumes_are_chowned_only_when_their_root_is_not(default_objects) -> None:
    for where, spec in pods(default_objects).items():
        assert spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch", where


def test_an_nfs_group_reaches_every_pod(tmp_path: Path) -> None:
    """NFS backends ignore fsGroup: the export's group as a supplemental group instead."""
    path = values_file(tmp_path, {"podSecurityContext": {
        "runAsNonRoot": True, "runAsUser": 10001, "supplementalGroups": [2049]}})  # fmt: skip
    for where, spec in pods(render(path)).items():
        assert spec["securityContext"]["supplementalGroups"] == [2049], where


# 5. Security ---------------------------------------------------------------------------------


def notes(*sets: str) -> str:
    args = [a for s in sets for a in ("--set", s)]
    result = helm("install", "clawrl", str(CHART), "--dry-run=client", "-f", str(CLUSTER_VALUES),
                  *args)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


def test_the_gateway_needs_api_keys_or_an_explicit_open_access() -> None:
    """Whoever reaches an open gateway writes the data the policy is trained on."""
    code, _, stderr = template("-f", str(CLUSTER_VALUES), "--set", "gateway.allowOpenAccess=false")
    assert code != 0 and "gateway: set apiKeys or existingApiKeySecret" in stderr, stderr
    keyed = notes("gateway.allowOpenAccess=false", "gateway.apiKeys={k1}")
    assert "WARNING" not in keyed and "<one of your API keys>" in keyed
    assert "WARNING: the gateway has no API keys" in notes()
    code, _, stderr = template("-f", str(CLUSTER_VALUES), "--set", "gateway.allowOpenAccess=false",
                               "--set", "gateway.existingApiKeySecret=keys")  # fmt: skip
    assert code == 0, stderr


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], value)


def test_redis_auth_comes_from_a_secret_to_every_client(default_objects) -> None:
    assert "Redis has no password" in notes()
    assert "REDIS_PASSWORD" not in yaml.safe_dump(default_objects)
    objects = render(sets=("redis.auth.existingSecret=redis-auth", "redis.auth.key=pw"))
    clients = 0
    for where, spec in pods(objects).items():
        for container in spec.get("initContainers", []) + spec["containers"]:
            names = [e["name"] for e in container.get("env", [])]
            url = next(
                (e for e in container.get("env", []) if e["name"] == "CLAWRL_REDIS__URL"), None
            )
            if url is None:
                continue
            clients += 1
            assert url["value"] == "redis://:$(REDIS_PASSWORD)@clawrl-redis:6379/0", where
            # Defined before the URL: Kubernetes expands only variables listed earlier.
            assert names.index("REDIS_PASSWORD") < names.index("CLAWRL_REDIS__URL"), where
            secret = container["env"][names.index("REDIS_PASSWORD")]["valueFrom"]["secretKeyRef"]
            assert secret == {"name": "redis-auth", "key": "pw"}, where
    # gateway, judge, trainer head (driver and launcher) and workers, the weight-sync Job x2
    assert clients >= 7


@pytest.mark.integration
def test_the_rendered_redis_refuses_clients_without_the_password(tmp_path: Path) -> None:
    """The rendered redis-server arguments and client URL, expanded as Kubernetes does, on a
    real redis-server: the URL's password is accepted, no password is refused, and the readiness
    probe (redis-cli with REDISCLI_AUTH) passes."""
    import shutil
    import subprocess

    import redis

    from tests.conftest import ChildProcess, free_port, wait_until

    objects = render(sets=("redis.auth.existingSecret=redis-auth",))
    secret_env = {"REDIS_PASSWORD": "s3cret-pw"}
    (redis_pod,) = [s for w, s in pods(objects).items() if w.startswith("StatefulSet/")]
    container = next(c for c in redis_pod["containers"] if c["name"] == "redis")
    env = dict(secret_env)
    env.update({e["name"]: expand(e["value"], env) for e in container["env"] if "value" in e})
    args = [expand(a, env) for a in container["args"]]
    args[args.index("--dir") + 1] = str(tmp_path)
    port = free_port()
    server = ChildProcess(
        "redis-auth",
        [shutil.which("redis-server"), *args, "--port", str(port), "--bind", "127.0.0.1"],
        tmp_path,
    )
    try:
        cli, *command = container["readinessProbe"]["exec"]["command"]
        probe = [cli, "-p", str(port), *command]

        def ready() -> bool:
            run = subprocess.run(probe, env={"REDISCLI_AUTH": env["REDISCLI_AUTH"]},
                                 capture_output=True, text=True, check=False)  # fmt: skip
            return run.stdout.strip() == "PONG"

        wait_until(ready, 10, "redis-auth", server.proc)
        gateway = pods(objects)["Deployment/clawrl-gateway"]["containers"][0]
        url = next(e["value"] for e in gateway["env"] if e["name"] == "CLAWRL_REDIS__URL")
        url = expand(url, secret_env).replace("clawrl-redis:6379", f"127.0.0.1:{port}")
        assert redis.Redis.from_url(url).ping() is True
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(f"redis://127.0.0.1:{port}/0").ping()
    finally:
        server.stop()


def test_only_the_trainers_own_pods_reach_the_ray_cluster(default_objects) -> None:
    """Ray's dashboard runs submitted jobs: no other pod of the release may reach it."""
    (policy,) = [
        o for o in default_objects
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "clawrl-trainer"
    ]  # fmt: skip
    (any_port,) = [rule for rule in policy["spec"]["ingress"] if "ports" not in rule]
    assert any_port["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "clawrl", "app.kubernetes.io/instance": "clawrl",
        "app.kubernetes.io/component": "trainer"}}}]  # fmt: skip
    ray_pods = [meta["labels"] for where, meta in pod_templates(default_objects).items()
                if where.startswith("RayJob/")]  # fmt: skip
    assert len(ray_pods) == 3
    assert all(selects(any_port["from"][0]["podSelector"], labels) for labels in ray_pods)


def test_ray_token_auth_is_an_option(default_objects, crd_schema) -> None:
    from tests.helm.test_chart import crd_errors

    assert "authOptions" not in rayjob(default_objects)["spec"]["rayClusterSpec"]
    job = rayjob(render(sets=("trainer.rayTokenAuth=true",)))
    assert job["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    assert not crd_errors(job, crd_schema("RayJob", "v1"))
