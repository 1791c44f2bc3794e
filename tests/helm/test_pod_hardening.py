"""Pod hardening of the rendered chart: read-only root filesystems with a writable volume behind
every path a program writes, service-account tokens only where the Kubernetes API is used, and
images pinned by digest on request. Sandbox pods (the SandboxTemplate's) are pods too."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from tests.helm.conftest import DIGEST, PIN_EVERY_IMAGE, pod_specs, render
from tests.helm.test_chart import VALUES_FILES, objects_for, values_id

HOME = "/home/clawrl"

# What each container writes outside its image, by container name. A container the chart adds
# must be listed here: the test fails on a name it does not know.
TMP = ("/tmp",)  # Python's tempfile, gRPC/HTTP clients, kubernetes' client
WRITES: dict[str, tuple[str, ...]] = {
    "gateway": TMP,
    "judge": TMP,
    # SGLang: ZMQ IPC sockets in /tmp, torch inductor's cache; Triton, FlashInfer, DeepGEMM, CUDA
    # and xgrammar caches under $HOME; NCCL between tensor-parallel ranks in /dev/shm.
    "engine": (*TMP, HOME, "/dev/shm"),
    # Ray's session directory (/tmp/ray: logs, sockets, spilled objects), the object store in
    # /dev/shm, torch/Triton caches under $HOME; checkpoints and exported versions.
    "ray-head": (*TMP, HOME, "/dev/shm", "/checkpoints"),
    "ray-worker": (*TMP, HOME, "/dev/shm", "/checkpoints"),
    "ray-job-submitter": TMP,
    "weight-sync-launcher": TMP,
    "weight-sync": TMP,
    # Model downloads: huggingface_hub writes the files, its locks and HF_HOME on the volume.
    "fetch-model": (*TMP, "/models"),
    "fetch-policy-tokenizer": (*TMP, "/models"),
    "fetch-judge-tokenizer": (*TMP, "/models"),
    # The append-only file; redis-server writes nothing else.
    "redis": ("/data",),
    # redis_exporter (Go) keeps everything in memory.
    "redis-exporter": (),
    # The `helm test` hook: Python's tempfile at most.
    "gateway-turn": TMP,
    # The sandbox service: the kubernetes client's temp files; the local backend's workspaces.
    "environments": TMP,
    "agent-runner": TMP,
    # A sandbox: the task's workspace (also $HOME) and /tmp, nothing else.
    "sandbox": ("/workspace", *TMP),
}
# Environment variables naming a directory a program writes: each must lie on a writable volume.
WRITTEN_DIRS_ENV = ("HOME", "HF_HOME", "TMPDIR", "XDG_CACHE_HOME", "TRITON_CACHE_DIR")


def containers(objects: list[dict]):
    """(where, pod spec, container, pod-level volume names) of every container and init
    container; a StatefulSet's claim templates count as pod volumes."""
    for obj in objects:
        claims = [
            t["metadata"]["name"] for t in obj.get("spec", {}).get("volumeClaimTemplates", [])
        ]
        for where, spec in pod_specs(obj):
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            volumes.update({name: {"name": name, "persistentVolumeClaim": {}} for name in claims})
            for container in spec.get("initContainers", []) + spec["containers"]:
                yield f"{where}/{container['name']}", spec, container, volumes


def writable_mount(path: str, container: dict, volumes: dict) -> str | None:
    """The writable mount (path) holding `path`, or None: a mount of a writable volume kind
    (emptyDir, PVC), not read-only, at `path` or a parent of it."""
    best = None
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})
        if mount.get("readOnly") or not ({"emptyDir", "persistentVolumeClaim"} & volume.keys()):
            continue
        if PurePosixPath(path).is_relative_to(mount["mountPath"]):
            if best is None or len(mount["mountPath"]) > len(best):
                best = mount["mountPath"]
    return best


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_every_container_has_a_read_only_root_filesystem(values: Path | None) -> None:
    found = [
        where
        for where, spec, container, _ in containers(objects_for(values))
        if container.get("securityContext", {}).get("readOnlyRootFilesystem") is not True
    ]
    assert not found, f"writable root filesystem: {found}"


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_every_path_a_program_writes_is_a_writable_volume(values: Path | None) -> None:
    problems, seen = [], set()
    for where, _, container, volumes in containers(objects_for(values)):
        name = container["name"]
        assert name in WRITES, f"{where}: say in WRITES what this container writes"
        seen.add(name)
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if HOME in WRITES[name] and env.get("HOME") != HOME:
            # The CPU engine's image has another home: the chart sets it.
            problems.append(f"{where}: HOME is {env.get('HOME')!r}, not the {HOME} volume")
        for path in WRITES[name]:
            if not writable_mount(path, container, volumes):
                problems.append(f"{where}: {path} is not on a writable volume")
        for key in WRITTEN_DIRS_ENV:
            if env.get(key) and not writable_mount(env[key], container, volumes):
                problems.append(f"{where}: {key}={env[key]} is not on a writable volume")
    assert not problems, "\n".join(problems)
    assert {"gateway", "engine", "judge", "ray-head", "ray-worker", "redis"} <= seen


def test_the_writable_volume_check_sees_a_read_only_or_missing_mount() -> None:
    volumes = {"tmp": {"name": "tmp", "emptyDir": {}}, "cfg": {"name": "cfg", "configMap": {}}}
    tmp = {"name": "tmp", "mountPath": "/tmp"}
    assert writable_mount("/tmp/ray", {"volumeMounts": [tmp]}, volumes) == "/tmp"
    assert writable_mount("/tmpfoo", {"volumeMounts": [tmp]}, volumes) is None
    assert writable_mount("/tmp", {"volumeMounts": [{**tmp, "readOnly": True}]}, volumes) is None
    cfg = {"name": "cfg", "mountPath": "/tmp"}
    assert writable_mount("/tmp", {"volumeMounts": [cfg]}, volumes) is None
    assert writable_mount("/home/clawrl", {"volumeMounts": [tmp]}, volumes) is None


@pytest.mark.parametrize("values", VALUES_FILES, ids=values_id)
def test_only_the_ray_head_mounts_a_service_account_token(values: Path | None) -> None:
    tokens = {}
    for obj in objects_for(values):
        for where, spec in pod_specs(obj):
            tokens[where] = spec.get("automountServiceAccountToken")
    # The trainer driver and the weight-sync launcher in the head create and watch the
    # weight-sync Jobs through the API server (its Role); no other pod talks to it but the
    # sandbox service's kubernetes backend (it claims sandboxes and execs into them).
    head = "RayJob/clawrl-trainer/head"
    assert tokens.pop(head) is True
    if values is not None and values.name == "values-terminal.yaml":
        assert tokens.pop("Deployment/clawrl-environments") is True
        assert tokens["SandboxTemplate/clawrl-sandbox"] is False
    assert tokens and set(tokens.values()) == {False}, tokens
    spec = next(s for o in objects_for(values) for w, s in pod_specs(o) if w == head)
    assert spec["serviceAccountName"] == "clawrl-trainer"


def all_images(objects: list[dict]) -> dict[str, str]:
    return {where: c["image"] for where, _, c, _ in containers(objects)}


def test_images_are_pinned_by_digest_on_request() -> None:
    tagged = all_images(objects_for(None))
    assert tagged and not [image for image in tagged.values() if "@" in image]
    pinned = all_images(render(sets=PIN_EVERY_IMAGE))
    assert pinned.keys() == tagged.keys()
    for where, image in pinned.items():
        # The same repository as the tagged image, the tag replaced by the digest.
        assert image == tagged[where].rsplit(":", 1)[0] + "@" + DIGEST, where
    assert pinned["Deployment/clawrl-gateway/gateway"] == f"ghcr.io/clawrl/clawrl-gateway@{DIGEST}"
    assert pinned["StatefulSet/clawrl-redis/redis"] == f"docker.io/library/redis@{DIGEST}"
    # One component pinned, the others keep their tags.
    one = all_images(render(sets=(f"judge.image.digest={DIGEST}",)))
    assert {w for w, image in one.items() if "@" in image} == {
        w for w in tagged if w.startswith("Deployment/clawrl-judge/")
    }
