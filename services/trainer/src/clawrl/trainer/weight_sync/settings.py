"""The weight-sync job's one settings object (env `CLAWRL_<SECTION>__<FIELD>`, or `clawrl.toml`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from clawrl.common.settings import ClawrlSettings, ModelSettings, RedisSettings, Section
from clawrl.common.tenants import TenantSettings


class GatewayTargets(Section):
    """Which gateway replicas a sync pauses, and how."""

    addresses: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:30001"],
        description="GatewayControl addresses (host:port) of every replica, when `service` is "
        "unset (local runs).",
    )
    service: str | None = Field(
        None,
        description="DNS name of the gateways' headless Service (Kubernetes): every address it "
        "resolves to is a replica; `port` is their GatewayControl port. Replaces `addresses`.",
    )
    port: int = Field(30001, gt=0, lt=65536, description="GatewayControl port with `service`.")
    token: SecretStr | None = Field(
        None, description="Bearer token of GatewayControl (the gateways' control.token)."
    )
    drain_timeout_s: float = Field(
        0.25,
        gt=0,
        description="Drain budget: how long Pause waits for in-flight generations to finish "
        "before the engines load (what happens to those still running: engines.in_flight). "
        "Short, since it adds to the pause every user sees.",
    )
    lease_s: float = Field(
        10.0,
        gt=0,
        description="Lease of the pause: if this job dies, the gateways resume by themselves "
        "this long after the last renewal. The job renews every lease_s / 3.",
    )
    call_timeout_s: float = Field(
        10.0, gt=0, description="Deadline of one GatewayControl call (Pause adds the drain)."
    )


class EngineTargets(Section):
    """Which policy-engine replicas load the new weights."""

    urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30010"],
        description="Base URLs of every policy engine replica (SGLang API), when `service` is "
        "unset (local runs).",
    )
    service: str | None = Field(
        None,
        description="DNS name of the policy engines' headless Service (Kubernetes): every "
        "address it resolves to is a replica, reached at http://<address>:<port>.",
    )
    port: int = Field(30010, gt=0, lt=65536, description="Engine HTTP port with `service`.")
    load_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for one /update_weights_from_disk."
    )
    call_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest wait for the engines' quick calls (/get_model_info, "
        "/pause_generation, /continue_generation, listing adapters): a hung engine fails the "
        "sync in seconds, not after the load timeout.",
    )
    in_flight: Literal["retract", "wait"] = Field(
        "retract",
        description="Generations still running when the drain budget ends: `retract` pauses "
        "every engine (/pause_generation mode=retract), loads at once, then "
        "/continue_generation: they go on under the new weights (such turns record both "
        "versions and are masked, not trained) and the pause is about drain budget + load. "
        "`wait`: the engines load once they finished (the pause lasts as long as the longest "
        "generation).",
    )


class SyncSettings(Section):
    """Mutual exclusion and the record every sync leaves."""

    lock_key: str = Field(
        "clawrl:weight-sync:lock",
        description="Redis key of the lock that keeps two syncs from running at once.",
    )
    lock_ttl_s: float = Field(
        60.0,
        gt=0,
        description="Time to live of the lock; renewed while the sync works, so a killed job "
        "frees it after at most this long.",
    )
    results_stream: str = Field(
        "clawrl:weight-syncs",
        description="Stream of sync results (version, outcome, reason, pause and load seconds).",
    )
    served_key: str = Field(
        "clawrl:serving",
        description="Redis hash recording the version the gateways route to, and its LoRA "
        "adapter (the gateways' control.served_key): read by a starting gateway and by the "
        "launcher, which loads that adapter back into engines that restarted.",
    )
    unload_wait_s: float = Field(
        30.0,
        ge=0,
        description="After a LoRA switch, how long the job waits for the gateways' requests on "
        "old adapters to finish before unloading them; one still in use then stays loaded "
        "(the next sync unloads it).",
    )


class LauncherSettings(Section):
    """The watcher that turns 'version N is ready' into one sync (newest wins)."""

    mode: Literal["local", "kubernetes"] = Field(
        "local",
        description="`local`: each sync is a child process (make run). `kubernetes`: each sync "
        "is a Job built from job_template and created through the Kubernetes API.",
    )
    job_template: Path = Field(
        Path("/etc/clawrl/weight-sync/job.yaml"),
        description="A batch/v1 Job manifest (the chart's ConfigMap, mounted): its container "
        "`weight-sync` runs clawrl-weight-sync; the launcher adds `run --version N --path P`.",
    )
    namespace: str | None = Field(
        None,
        description="Namespace of the Jobs; unset = the pod's own namespace (service account).",
    )
    max_attempts: int = Field(
        3, gt=0, description="Syncs tried for one version before waiting for a newer one."
    )
    retry_backoff_s: float = Field(5.0, ge=0, description="Wait between two failed attempts.")
    job_timeout_s: float = Field(
        900.0, gt=0, description="A sync (process or Job) running longer than this is killed."
    )
    reconcile_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often the launcher checks that every engine holds the LoRA adapter "
        "the gateways route to, and loads it into one that lacks it (an engine restarted); and "
        "(full weights) that every engine serves the synced version and every gateway admits "
        "it, else syncs that version again.",
    )
    metrics_port: int | None = Field(
        None, ge=0, lt=65536, description="Serve Prometheus /metrics on this port (unset: no)."
    )


class WeightSyncSettings(ClawrlSettings):
    """Everything the sync job and its launcher need, built once at start."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    gateways: GatewayTargets = Field(default_factory=GatewayTargets)
    engines: EngineTargets = Field(default_factory=EngineTargets)
    sync: SyncSettings = Field(default_factory=SyncSettings)
    launcher: LauncherSettings = Field(default_factory=LauncherSettings)
    # Only `mode` matters here: in shared mode tenants' versions are neither followed nor served.
    tenants: TenantSettings = Field(default_factory=TenantSettings)

    @model_validator(mode="after")
    def _check(self) -> WeightSyncSettings:
        if not (self.gateways.service or self.gateways.addresses):
            raise ValueError("gateways: set `service` (Kubernetes) or at least one address")
        if not (self.engines.service or self.engines.urls):
            raise ValueError("engines: set `service` (Kubernetes) or at least one URL")
        if self.sync.lock_ttl_s < self.gateways.lease_s:
            raise ValueError(
                f"sync.lock_ttl_s ({self.sync.lock_ttl_s}) must be at least gateways.lease_s "
                f"({self.gateways.lease_s}): a second sync must not start while a dead job's "
                "pause lease still runs"
            )
        return self
