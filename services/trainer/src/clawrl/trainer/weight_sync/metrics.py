"""The weight sync's Prometheus metrics (the launcher's registry; the jobs themselves are
short-lived, so their figures reach these metrics through the results stream)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class WeightSyncMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
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
