"""The kubernetes backend: each sandbox is an agent-sandbox SandboxClaim on a warm pool
(kubernetes-sigs/agent-sandbox, API extensions.agents.x-k8s.io/v1beta1, v0.5 or newer), and its
commands run by pod exec in the claimed Sandbox's pod (kube_exec.py).

Lifecycle of a sandbox:
- create: a SandboxClaim naming the warm pool, labelled with this service's `owner` and the
  sandbox id, whose `lifecycle.shutdownTime` is `claim_ttl_s` ahead with shutdownPolicy Delete:
  if this service dies, agent-sandbox's controller deletes the claim (and with it the Sandbox and
  its pod) at that time at the latest. The claim is polled until Ready (a terminal reason, e.g.
  WarmPoolNotFound, fails at once); its Sandbox names the pod; the task's tools are looked up
  and its files unpacked into /workspace, then its setup runs.
- exec: one pod exec (kube_exec.RUN_SCRIPT). A claim whose shutdownTime is less than half its
  TTL away is moved on first, so a long lease is never cut by its own safety net.
- reset: every process killed, the workspace and /tmp emptied in place (the warm pod is kept),
  then seeded again.
- destroy: the claim deleted (agent-sandbox deletes the Sandbox and the pod); a claim already
  gone is fine.
- list_live: the claims labelled with this owner, so a restarted service deletes its
  predecessor's.

k8s-agent-sandbox (PyPI) supplies the API's group, version and the claim's terminal Ready
reasons; its own command execution talks HTTP to a runtime server inside the sandbox, which a
sandbox without network (the chart's NetworkPolicy) cannot serve, so commands go by pod exec
with the official kubernetes client instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import Field

from clawrl.common.settings import Section
from clawrl.environments.backend import (
    WORKSPACE,
    ExecResult,
    IsolationUnavailable,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    SpecError,
)
from clawrl.environments.kube_exec import KubernetesExec, PodShell, PodTransport
from clawrl.environments.local import ENV_NAME, safe_relative

log = logging.getLogger(__name__)

NAME = "kubernetes"
CLAIM_GROUP, CLAIM_VERSION, CLAIM_PLURAL = "extensions.agents.x-k8s.io", "v1beta1", "sandboxclaims"
SANDBOX_GROUP, SANDBOX_VERSION, SANDBOX_PLURAL = "agents.x-k8s.io", "v1beta1", "sandboxes"
POOL_PLURAL = "sandboxwarmpools"
OWNER_LABEL = "clawrl.io/sandbox-owner"
ID_LABEL = "clawrl.io/sandbox-id"
# A Sandbox adopted from a warm pool may keep its pod's older name here (agent-sandbox's
# SandboxPodNameAnnotation); otherwise the pod has the Sandbox's name.
POD_NAME_ANNOTATION = "agents.x-k8s.io/pod-name"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
POLL_S = 0.5


class KubeSandboxSettings(Section):
    """The kubernetes backend: agent-sandbox claims from a warm pool."""

    namespace: str = Field("default", description="Namespace of the warm pool and the claims.")
    warm_pool: str = Field("", description="The SandboxWarmPool claims name (required).")
    owner: str = Field(
        "clawrl-environments",
        description="Label value marking this service's claims (clawrl.io/sandbox-owner); a "
        "restarted service deletes the claims it finds with it. One per service.",
    )
    container: str = Field("sandbox", description="The sandbox pod's container commands run in.")
    claim_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="A claim's shutdownTime is this far ahead (moved on while the sandbox is "
        "used): agent-sandbox deletes the sandbox of a service that died by then.",
    )
    ready_timeout_s: float = Field(
        180.0, gt=0, description="How long a claim may take to become Ready."
    )
    api_timeout_s: float = Field(30.0, gt=0, description="Timeout of one Kubernetes API call.")
    reap: bool = Field(
        True,
        description="Kill every other process of the sandbox after each command (kill -9 -1 in "
        "the pod; pid 1 is spared), so nothing a command started outlives it.",
    )


def claim_name(owner: str, sandbox_id: str) -> str:
    """A DNS-1123 name for the claim, unique per (owner, sandbox id)."""
    raw = f"{owner}-{sandbox_id}".lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")
    if len(name) > 63 or name != raw:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:10]
        name = f"{name[:52].strip('-')}-{digest}"
    return name


def claim_manifest(
    name: str, *, warm_pool: str, owner: str, sandbox_id: str, shutdown_at: datetime
) -> dict[str, Any]:
    """The SandboxClaim the backend creates (validated against agent-sandbox's CRD in tests)."""
    return {
        "apiVersion": f"{CLAIM_GROUP}/{CLAIM_VERSION}",
        "kind": "SandboxClaim",
        "metadata": {
            "name": name,
            "labels": {
                OWNER_LABEL: owner,
                ID_LABEL: sandbox_id,
                "app.kubernetes.io/managed-by": "clawrl-environments",
            },
        },
        "spec": {"warmPoolRef": {"name": warm_pool}, "lifecycle": lifecycle(shutdown_at)},
    }


def lifecycle(shutdown_at: datetime) -> dict[str, str]:
    """Delete (not Retain): an expired claim goes away with its Sandbox and pod."""
    stamp = shutdown_at.astimezone(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"shutdownTime": stamp, "shutdownPolicy": "Delete"}


@dataclass(frozen=True)
class ClaimState:
    """ready: the sandbox's name; failed: why (a reason the controller will not retry)."""

    ready: bool
    sandbox: str | None
    failed: str | None = None
    reason: str = ""


def claim_state(claim: Mapping[str, Any], terminal: frozenset[str]) -> ClaimState:
    """Where a claim stands, from its status (the Ready condition, status.sandbox.name)."""
    status = claim.get("status") or {}
    sandbox = (status.get("sandbox") or {}).get("name") or None
    for condition in status.get("conditions") or []:
        if condition.get("type") != "Ready":
            continue
        reason = condition.get("reason", "")
        if condition.get("status") == "True":
            return ClaimState(sandbox is not None, sandbox, reason=reason)
        if reason in terminal or reason in ("TemplateNotFound", "WarmPoolNotFound"):
            return ClaimState(False, sandbox, f"{reason}: {condition.get('message', '')}", reason)
        return ClaimState(False, sandbox, reason=reason)
    return ClaimState(False, sandbox)


def pod_of(sandbox: Mapping[str, Any]) -> str:
    annotations = (sandbox.get("metadata") or {}).get("annotations") or {}
    return annotations.get(POD_NAME_ANNOTATION) or sandbox["metadata"]["name"]


def check_spec(spec: SandboxSpec) -> None:
    """What the backend cannot honour fails before a claim is made."""
    for name in spec.env:
        if not ENV_NAME.match(name):
            raise SpecError(f"environment variable name {name!r} is not valid")
    for path in spec.files:
        safe_relative(path)


def base_env(spec: SandboxSpec) -> dict[str, str]:
    return {"HOME": WORKSPACE, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb", **spec.env}


class KubeApiError(SandboxError):
    """A Kubernetes API call failed (status None: it never got an answer)."""

    def __init__(self, what: str, status: int | None, reason: str | None, body: Any) -> None:
        self.status, self.reason = status, reason
        detail = str(body or "").strip()[:300]
        super().__init__(f"{what}: {status or 'no answer'} {reason or ''} {detail}".strip())


@dataclass
class _Live:
    spec: SandboxSpec
    shell: PodShell
    claim: str
    renew_at: float  # time.time() after which the claim's shutdownTime is moved on


class KubeBackend:
    """Sandboxes as agent-sandbox claims; see the module docstring."""

    name = NAME

    def __init__(
        self,
        settings: KubeSandboxSettings,
        api_client: Any = None,
        transport: PodTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from k8s_agent_sandbox.constants import TERMINAL_CLAIM_READY_REASONS
        from kubernetes import client

        if not settings.warm_pool:
            raise IsolationUnavailable("kube_sandbox.warm_pool is not set: no pool to claim from")
        self.settings, self.clock = settings, clock
        self.terminal = frozenset(TERMINAL_CLAIM_READY_REASONS)
        self.api_client = api_client or client.ApiClient()
        self.custom = client.CustomObjectsApi(self.api_client)
        self.transport = transport or KubernetesExec(
            client.CoreV1Api(self.api_client), settings.namespace, settings.container
        )
        self._live: dict[str, _Live] = {}

    # --- the API, each call blocking in a worker thread, ApiException -> SandboxError -----

    async def _call(self, what: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        kwargs.setdefault("_request_timeout", self.settings.api_timeout_s)
        try:
            return await asyncio.to_thread(method, **kwargs)
        except ApiException as exc:
            raise KubeApiError(what, exc.status, exc.reason, exc.body) from exc
        except Exception as exc:  # urllib3's connection errors have no common base with it
            raise KubeApiError(what, None, type(exc).__name__, str(exc)) from exc

    async def _claim_call(self, what: str, call: str, **kwargs: Any) -> Any:
        """One call of CustomObjectsApi's `call` on this namespace's SandboxClaims."""
        return await self._call(
            what, getattr(self.custom, call), group=CLAIM_GROUP, version=CLAIM_VERSION,
            plural=CLAIM_PLURAL, namespace=self.settings.namespace, **kwargs,
        )  # fmt: skip

    # --- claims -----------------------------------------------------------------------------

    def _shutdown_at(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC) + timedelta(
            seconds=self.settings.claim_ttl_s
        )

    async def _claim(self, sandbox_id: str) -> str:
        """Create the claim and wait until it is Ready; the pod's name."""
        s = self.settings
        name = claim_name(s.owner, sandbox_id)
        body = claim_manifest(
            name, warm_pool=s.warm_pool, owner=s.owner, sandbox_id=sandbox_id,
            shutdown_at=self._shutdown_at(),
        )  # fmt: skip
        await self._claim_call(
            f"creating claim {name}", "create_namespaced_custom_object", body=body
        )
        deadline = time.monotonic() + s.ready_timeout_s
        state = ClaimState(False, None)
        while time.monotonic() < deadline:
            claim = await self._claim_call(
                f"reading claim {name}", "get_namespaced_custom_object", name=name
            )
            state = claim_state(claim, self.terminal)
            if state.failed:
                raise SandboxError(f"claim {name} failed: {state.failed}")
            if state.ready and state.sandbox:
                sandbox = await self._call(
                    f"reading sandbox {state.sandbox}",
                    self.custom.get_namespaced_custom_object,
                    group=SANDBOX_GROUP, version=SANDBOX_VERSION, plural=SANDBOX_PLURAL,
                    namespace=s.namespace, name=state.sandbox,
                )  # fmt: skip
                return pod_of(sandbox)
            await asyncio.sleep(POLL_S)
        raise SandboxError(
            f"claim {name} not Ready within {s.ready_timeout_s:.0f}s (last reason: "
            f"{state.reason or 'none'}; is warm pool {s.warm_pool} large enough?)"
        )

    async def _delete_claim(self, name: str) -> None:
        try:
            await self._claim_call(
                f"deleting claim {name}", "delete_namespaced_custom_object", name=name
            )
        except KubeApiError as exc:
            if exc.status != 404:  # already gone: expired, or deleted by an earlier call
                raise

    async def _renew(self, live: _Live) -> None:
        """Move the claim's shutdownTime on once half its TTL has passed."""
        if self.clock() < live.renew_at:
            return
        body = {"spec": {"lifecycle": lifecycle(self._shutdown_at())}}
        await self._claim_call(
            f"renewing claim {live.claim}", "patch_namespaced_custom_object",
            name=live.claim, body=body,
        )  # fmt: skip
        live.renew_at = self.clock() + self.settings.claim_ttl_s / 2

    # --- the protocol -----------------------------------------------------------------------

    async def probe(self) -> None:
        """The warm pool must exist and be readable: else the service must not start."""
        s = self.settings
        try:
            await self._call(
                f"reading warm pool {s.warm_pool}",
                self.custom.get_namespaced_custom_object,
                group=CLAIM_GROUP, version=CLAIM_VERSION, plural=POOL_PLURAL,
                namespace=s.namespace, name=s.warm_pool,
            )  # fmt: skip
        except KubeApiError as exc:
            raise IsolationUnavailable(
                f"agent-sandbox warm pool {s.warm_pool} in namespace {s.namespace} cannot be "
                f"used: {exc} (is agent-sandbox v0.5+ with its extensions installed, the pool "
                "created, and the service account allowed?)"
            ) from exc

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> SandboxHandle:
        check_spec(spec)
        if sandbox_id in self._live:
            raise SandboxError(f"sandbox {sandbox_id} already exists")
        name = claim_name(self.settings.owner, sandbox_id)
        handle = SandboxHandle(sandbox_id, NAME, {"claim": name})
        try:
            pod = await self._claim(sandbox_id)
            shell = PodShell(
                self.transport, pod, workspace=WORKSPACE, reap=self.settings.reap,
                api_timeout_s=self.settings.api_timeout_s,
            )  # fmt: skip
            renew_at = self.clock() + self.settings.claim_ttl_s / 2
            self._live[sandbox_id] = _Live(spec, shell, name, renew_at)
            await self._prepare(self._live[sandbox_id], spec)
        except BaseException:
            await self._forget(handle)
            raise
        return SandboxHandle(sandbox_id, NAME, {"claim": name, "pod": pod})

    async def _prepare(self, live: _Live, spec: SandboxSpec) -> None:
        """Tools checked, files unpacked, setup run: a fresh workspace for spec."""
        missing = await live.shell.missing_tools(list(spec.tools))
        if missing:
            raise SpecError(f"tools not in the sandbox image: {', '.join(missing)}")
        await live.shell.seed(spec.files)
        live.spec = spec
        if spec.setup:
            result = await self._run(live, spec.setup, None, None)
            if result.exit_code != 0:
                tail = (result.stderr or result.stdout).strip()[-300:]
                raise SpecError(f"the task's setup failed (exit {result.exit_code}): {tail}")

    async def _run(
        self, live: _Live, command: str, timeout_s: float | None, stdin: bytes | None
    ) -> ExecResult:
        await self._renew(live)
        limits = live.spec.limits
        timeout = timeout_s if timeout_s is not None else limits.timeout_s
        return await live.shell.run(command, limits, timeout, env=base_env(live.spec), stdin=stdin)

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        tools: Sequence[str] = (),
    ) -> ExecResult:
        live = self._live.get(handle.id)
        if live is None:
            raise SandboxError(f"sandbox {handle.id} does not exist")
        extra = [t for t in tools if t not in live.spec.tools]
        missing = await live.shell.missing_tools(extra)
        if missing:
            raise SpecError(f"tools not in the sandbox image: {', '.join(missing)}")
        return await self._run(live, command, timeout_s, stdin)

    async def reset(self, handle: SandboxHandle, spec: SandboxSpec) -> SandboxHandle:
        check_spec(spec)
        live = self._live.get(handle.id)
        if live is None:
            return await self.create(handle.id, spec)
        await live.shell.wipe()
        await self._prepare(live, spec)
        return handle

    async def _forget(self, handle: SandboxHandle) -> None:
        self._live.pop(handle.id, None)
        await self._delete_claim(
            handle.data.get("claim") or claim_name(self.settings.owner, handle.id)
        )

    async def destroy(self, handle: SandboxHandle) -> None:
        await self._forget(handle)

    async def list_live(self) -> list[SandboxHandle]:
        selector = f"{OWNER_LABEL}={self.settings.owner}"
        listed = await self._claim_call(
            "listing claims", "list_namespaced_custom_object", label_selector=selector
        )
        handles = []
        for item in listed.get("items", []):
            metadata = item.get("metadata") or {}
            sandbox_id = (metadata.get("labels") or {}).get(ID_LABEL)
            if sandbox_id and metadata.get("name"):
                handles.append(SandboxHandle(sandbox_id, NAME, {"claim": metadata["name"]}))
        return handles

    async def aclose(self) -> None:
        for sandbox_id, live in list(self._live.items()):
            try:
                await self.destroy(SandboxHandle(sandbox_id, NAME, {"claim": live.claim}))
            except SandboxError as exc:
                # Its shutdownTime still ends it; the next start's list_live finds it too.
                log.error("claim %s not deleted at shutdown: %s", live.claim, exc)
        await asyncio.to_thread(self.api_client.close)


def create_backend(settings: Any) -> KubeBackend:
    """The backend from the service's settings (its `kube_sandbox` section), with the in-cluster
    service account's credentials, else the local kubeconfig."""
    from kubernetes import client, config

    section = getattr(settings, "kube_sandbox", None)
    if section is None:
        raise IsolationUnavailable(
            "leases.backend kubernetes needs the settings section kube_sandbox "
            "(EnvironmentsSettings.kube_sandbox: KubeSandboxSettings)"
        )
    if section.claim_ttl_s <= settings.leases.ttl_s:
        raise IsolationUnavailable(
            f"kube_sandbox.claim_ttl_s ({section.claim_ttl_s:.0f}) must exceed leases.ttl_s "
            f"({settings.leases.ttl_s:.0f}): a live lease's claim would expire first"
        )
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return KubeBackend(section, client.ApiClient())
