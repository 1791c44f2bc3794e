"""Weight syncs as Kubernetes Jobs, built from the chart's template.

Template shape (what the chart provides): a ConfigMap whose key `job.yaml` holds one complete
`batch/v1` Job manifest, mounted into the launcher's pod (default path
/etc/clawrl/weight-sync/job.yaml, setting `launcher.job_template`). Its pod template has a
container named `weight-sync` that runs the `clawrl-weight-sync` entrypoint (trainer image) with
the sync settings as `CLAWRL_*` env (gateways.service, engines.service, redis.url, tokens from
Secrets). `metadata.name` (or `generateName`) is used as the name prefix. For each version the
launcher adds: the name `<prefix>-v<N>-<suffix>`, labels `app.kubernetes.io/component:
weight-sync`, `clawrl.io/policy-version: N` and, for a tenant's adapter, `clawrl.io/tenant: <id>`
(Job and pod), the container args `run --version N --path <checkpoint> --job-id <name>` (and
`--adapter`, `--tenant`), and, where the template leaves them unset, `backoffLimit: 0`
(retries are the launcher's, newest version first), `restartPolicy: Never`,
`activeDeadlineSeconds` (launcher.job_timeout_s) and `ttlSecondsAfterFinished: 600`. The
launcher's service account needs `create`, `get` and `delete` on `jobs` in the namespace.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import secrets
import time
from pathlib import Path
from typing import Any

import yaml

from clawrl.common.versions import VersionReady
from clawrl.trainer.weight_sync.launcher import run_args

log = logging.getLogger(__name__)

CONTAINER = "weight-sync"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def job_name(prefix: str, version: int, suffix: str) -> str:
    """A DNS-1123 name that fits a label value (63 characters)."""
    prefix = re.sub(r"[^a-z0-9-]", "-", prefix.lower()).strip("-") or "clawrl-weight-sync"
    tail = f"-v{version}-{suffix}"
    return prefix[: 63 - len(tail)].rstrip("-") + tail


def build_job(
    template: dict[str, Any], ready: VersionReady, *, timeout_s: float, suffix: str
) -> dict[str, Any]:
    """The Job that syncs `ready`, from the chart's template; ValueError when the template is
    not a Job with a `weight-sync` container."""
    if template.get("apiVersion") != "batch/v1" or template.get("kind") != "Job":
        raise ValueError("the weight-sync job template must be a batch/v1 Job")
    job = copy.deepcopy(template)
    meta = job.setdefault("metadata", {})
    prefix = meta.pop("name", None) or meta.pop("generateName", None) or "clawrl-weight-sync"
    meta.pop("generateName", None)
    name = job_name(prefix, ready.version, suffix)
    meta["name"] = name
    labels = {
        "app.kubernetes.io/component": "weight-sync",
        "clawrl.io/policy-version": str(ready.version),
    }
    if ready.tenant:  # a tenant id is a valid label value (clawrl.common.tenants.TENANT_ID)
        labels["clawrl.io/tenant"] = ready.tenant
    meta.setdefault("labels", {}).update(labels)
    spec = job.setdefault("spec", {})
    spec.setdefault("backoffLimit", 0)
    spec.setdefault("activeDeadlineSeconds", int(timeout_s))
    spec.setdefault("ttlSecondsAfterFinished", 600)
    pod = spec.setdefault("template", {})
    pod.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
    pod_spec = pod.setdefault("spec", {})
    pod_spec.setdefault("restartPolicy", "Never")
    containers = [c for c in pod_spec.get("containers", []) if c.get("name") == CONTAINER]
    if not containers:
        raise ValueError(f"the weight-sync job template needs a container named {CONTAINER!r}")
    container = containers[0]
    container["args"] = [*container.get("args", []), *run_args(ready, name)]
    return job


def load_template(path: Path) -> dict[str, Any]:
    try:
        template = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read the weight-sync job template {path}: {exc}") from exc
    if not isinstance(template, dict):
        raise ValueError(f"the weight-sync job template {path} is not a mapping")
    return template


def batch_api() -> Any:
    """The BatchV1Api of the pod's service account, else of the local kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.BatchV1Api()


def api_errors() -> tuple[type[Exception], ...]:
    """What a kubernetes client call raises when the API refuses it or cannot be reached
    (imported late: the client is slow to import and `run` does not need it)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    return (ApiException, HTTPError)


class KubernetesLauncher:
    """Runs each sync as a Job and waits for it; returns 0 when it succeeded. The API errors
    it meets are logged and end the attempt with 1 (the watcher retries, counts it crashed);
    a Job that outlives its deadline, or whose launcher stops, is deleted."""

    def __init__(
        self,
        template: dict[str, Any],
        namespace: str | None,
        timeout_s: float,
        *,
        api: Any = None,
        poll_s: float = 2.0,
        grace_s: float = 60.0,
    ):
        self.api = api if api is not None else batch_api()
        self.errors = api_errors()
        self.template = template
        self.namespace = namespace or NAMESPACE_FILE.read_text().strip()
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.grace_s = grace_s  # past activeDeadlineSeconds: time for Kubernetes to end it

    async def __call__(self, ready: VersionReady) -> int:
        job = build_job(self.template, ready, timeout_s=self.timeout_s, suffix=secrets.token_hex(3))
        name = job["metadata"]["name"]
        try:
            await asyncio.to_thread(self.api.create_namespaced_job, self.namespace, job)
        except self.errors as exc:
            log.error("cannot create Job %s/%s: %s", self.namespace, name, describe(exc))
            return 1
        log.info("created Job %s/%s for v%d", self.namespace, name, ready.version)
        try:
            return await self._wait(name)
        except asyncio.CancelledError:
            # The launcher stops: so does the sync (its pod gets SIGTERM and resumes the
            # gateways).
            await asyncio.shield(self._delete(name, "the launcher is stopping"))
            raise

    async def _wait(self, name: str) -> int:
        deadline = time.monotonic() + self.timeout_s + self.grace_s
        while time.monotonic() < deadline:
            await asyncio.sleep(self.poll_s)
            try:
                job = await asyncio.to_thread(
                    self.api.read_namespaced_job_status, name, self.namespace
                )
            except self.errors as exc:  # an API server hiccup: the Job runs on; ask again
                log.warning("cannot read Job %s: %s", name, describe(exc))
                continue
            if job.status.succeeded:
                return 0
            if job.status.failed:
                log.error("Job %s failed (its log and the results stream say why)", name)
                return 1
        await self._delete(name, "it did not finish in time")
        return 1

    async def _delete(self, name: str, why: str) -> None:
        log.error("deleting Job %s/%s: %s", self.namespace, name, why)
        try:
            await asyncio.to_thread(
                self.api.delete_namespaced_job,
                name,
                self.namespace,
                propagation_policy="Background",
            )
        except self.errors as exc:
            log.error("cannot delete Job %s/%s: %s", self.namespace, name, describe(exc))


def describe(exc: Exception) -> str:
    """An API error in one line: its status and reason, else the exception."""
    status = getattr(exc, "status", None)
    return f"{status} {getattr(exc, 'reason', '')}".strip() if status else repr(exc)
