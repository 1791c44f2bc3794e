"""The weight sync's Prometheus metrics (the launcher's registry; the jobs themselves are
short-lived, so their figures reach these metrics through the results stream)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from clawrl.trainer.weight_sync.job import SyncResult

SWITCH_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class WeightSyncMetrics:
    """The launcher's metrics; also the trainer's when it runs the syncs itself (nccl)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._syncs(self.registry)
        self._lora(self.registry)
        self._tenants(self.registry)

    def _syncs(self, r: CollectorRegistry) -> None:
        """Every sync: its outcome, pause and load, the versions, and what went wrong around it."""
        self.syncs = Counter(
            "clawrl_weight_sync_syncs_total",
            "Finished syncs by outcome (ok, skipped, failed, inconsistent, busy, crashed).",
            ["outcome"],
            registry=r,
        )
        self.pause = Histogram(
            "clawrl_weight_sync_pause_duration_seconds",
            "User-visible pause of a sync: first Pause sent to last Resume answered.",
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.load = Histogram(
            "clawrl_weight_sync_load_duration_seconds",
            "Time the policy engines took to load the new weights (slowest replica).",
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.continue_failures = Counter(
            "clawrl_weight_sync_continue_failures_total",
            "Engines the launcher could not /continue_generation after a sync that crashed.",
            registry=r,
        )
        self.lease_renewal_failures = Counter(
            "clawrl_weight_sync_lease_renewal_failures_total",
            "Pause-lease renewals that a gateway did not answer.",
            registry=r,
        )
        self.policy_version = Gauge(
            "clawrl_weight_sync_policy_version",
            "Policy version the last successful sync put into service.",
            registry=r,
        )
        self.announced_version = Gauge(
            "clawrl_weight_sync_announced_version",
            "Newest policy version the trainer announced.",
            registry=r,
        )
        self.broadcast_fallbacks = Counter(
            "clawrl_weight_sync_broadcast_fallbacks_total",
            "Broadcast syncs (transport nccl) whose broadcast failed, so the engines loaded the "
            "version from disk instead.",
            registry=r,
        )
        self.convergence_syncs = Counter(
            "clawrl_weight_sync_convergence_syncs_total",
            "Syncs of the served version the launcher started because replicas left it, by "
            "cause (engines: one serves other weights, e.g. restarted; gateways: one admits "
            "another version).",
            ["cause"],
            registry=r,
        )
        self.busy_waits = Counter(
            "clawrl_weight_sync_busy_waits_total",
            "Sync attempts that found the lock held (a running or dead sync) and waited for it "
            "instead of counting as a failed attempt.",
            registry=r,
        )

    def _lora(self, r: CollectorRegistry) -> None:
        """LoRA syncs: the switch with no pause, and the adapters loaded, kept and unloaded."""
        self.switch = Histogram(
            "clawrl_weight_sync_switch_duration_seconds",
            "LoRA syncs: first SwitchAdapter sent to the last answered (no pause).",
            buckets=SWITCH_BUCKETS_S,
            registry=r,
        )
        self.adapter_load = Histogram(
            "clawrl_weight_sync_adapter_load_duration_seconds",
            "LoRA syncs: time the engines took to load the adapter beside the served one "
            "(slowest replica).",
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.adapters_unloaded = Counter(
            "clawrl_weight_sync_adapters_unloaded_total",
            "Old LoRA adapters unloaded from engines after a switch, or after a tenant's "
            "release (its adapter reset or removed).",
            registry=r,
        )
        self.adapters_kept = Counter(
            "clawrl_weight_sync_adapters_kept_total",
            "Old LoRA adapters left loaded after a switch or a tenant's release: still in use "
            "when the wait ended, or their unload failed.",
            registry=r,
        )
        self.adapter_reloads = Counter(
            "clawrl_weight_sync_adapter_reloads_total",
            "Engines found without the adapter the gateways route to (restarted), by outcome "
            "of loading it back (loaded, failed), and engines that did not answer "
            "(unreachable).",
            ["outcome"],
            registry=r,
        )

    def _tenants(self, r: CollectorRegistry) -> None:
        """Per-tenant mode: each tenant's syncs and version."""
        self.tenant_syncs = Counter(
            "clawrl_weight_sync_tenant_syncs_total",
            "Per-tenant mode: finished syncs of one tenant's adapter, by tenant and outcome (ok, "
            "skipped, failed, busy, crashed); also counted in clawrl_weight_sync_syncs_total.",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_version = Gauge(
            "clawrl_weight_sync_tenant_version",
            "Per-tenant mode: the adapter version the last successful sync of a tenant put into "
            "service.",
            ["tenant"],
            registry=r,
        )
        self.tenant_unroutes = Counter(
            "clawrl_weight_sync_tenant_unroutes_total",
            "Per-tenant mode: gateways told to serve a tenant the shared policy again (its "
            "adapter reset or removed, or the tenant taken out of allow/pattern), by tenant and "
            "outcome (ok; failed: the gateway refused or did not answer, tried again).",
            ["tenant", "outcome"],
            registry=r,
        )

    def observe(self, result: SyncResult) -> None:
        """Count one finished sync."""
        self.syncs.labels(outcome=result.outcome).inc()
        if result.tenant:
            self.tenant_syncs.labels(tenant=result.tenant, outcome=result.outcome).inc()
        self.lease_renewal_failures.inc(result.renewal_failures)
        if result.broadcast_error:
            self.broadcast_fallbacks.inc()
        self.adapters_unloaded.inc(result.unloaded)
        self.adapters_kept.inc(result.kept)
        if result.outcome == "ok":
            self.pause.observe(result.pause_s)
            self.load.observe(result.load_s)
            if result.tenant:
                self.tenant_version.labels(tenant=result.tenant).set(result.version)
            else:
                self.policy_version.set(result.version)
            if result.adapter:
                self.switch.observe(result.switch_s)
                self.adapter_load.observe(result.load_s)
