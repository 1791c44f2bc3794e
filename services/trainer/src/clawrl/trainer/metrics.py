"""The trainer's Prometheus metrics, built on a registry made at start. Labels are bounded
(kinds and reasons); never a session or sample id."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from clawrl.common.metrics import LATENCY_BUCKETS_S, tenant_label

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
STEP_PHASES = ("logprobs", "forward_backward", "optimizer", "checkpoint", "export", "total")
DROP_REASONS = (
    "stale",
    "duplicate",
    "invalid",
    "mode",
    "undecodable",
    "step_failed",
    "backend_lost",
    "tenant_reset",
    "tenant_unrouted",
)

# Step figures exported as gauges, by the name `policy_objective` / the backend give them.
STEP_GAUGES = {
    "loss": "Total loss of the last step.",
    "pg_loss": "Policy-gradient part of the last step's loss.",
    "clip_frac": "Fraction of trained tokens whose PPO ratio pi / pi_old was clipped in the last "
    "step (0 while each batch gets one optimizer step: pi_old is recomputed right before it).",
    "ratio_mean": "Mean behaviour ratio pi_old / pi_rollout (trainer's current weights over the "
    "engine that sampled) over trained tokens in the last step.",
    "ratio_max": "Largest behaviour ratio pi_old / pi_rollout over trained tokens in the last "
    "step.",
    "tis_clip_frac": "Fraction of trained tokens whose TIS weight was truncated at ppo.tis_cap in "
    "the last step.",
    "staleness_mean": "Mean policy versions between the last step's samples and the trainer.",
    "staleness_max": "Most policy versions between a sample of the last step and the trainer.",
    "kl_ref": "KL to the reference model in the last step (when kl_coef > 0).",
    "approx_kl_old": "Mean old_logp - logp over trained tokens in the last step.",
    "entropy": "Mean policy entropy over trained tokens in the last step (nats).",
    "grad_norm": "Global gradient norm before clipping in the last step.",
    "reward_mean": "Mean reward of the last step's samples.",
    "advantage_mean": "Mean advantage over trained tokens in the last step.",
    "advantage_std": "Standard deviation of the advantages over trained tokens in the last step.",
    "old_rollout_abs_diff": "Mean |old_logp - rollout_logp| over trained tokens in the last step.",
    "tokens_per_second": "Trained tokens (prompt + response) per second of the last step.",
    "step_wise_dropped": "Samples of the last step in constant (task, turn index) buckets, "
    "taken out of the loss (advantage.estimator = step_wise with step_normalize).",
}


class TrainerMetrics:
    """Every metric the trainer exports, registered by concern."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._samples(self.registry)
        self._tenants(self.registry)
        self._steps(self.registry)

    def _samples(self, r: CollectorRegistry) -> None:
        """The samples the trainer reads: consumed, dropped, trained, how late."""
        self.samples_consumed = Counter(
            "clawrl_trainer_samples_consumed_total",
            "Samples read from the stream, by kind (trained, masked, dropped).",
            ["kind"],
            registry=r,
        )
        self.samples_dropped = Counter(
            "clawrl_trainer_samples_dropped_total",
            "Samples not trained, by reason (stale, duplicate, invalid, mode: judged in a mode the "
            "estimator does not train, undecodable, step_failed, backend_lost; per tenant: "
            "tenant_reset, served by an adapter since reset or removed, and tenant_unrouted, "
            "served by the adapter of a tenant no longer selected).",
            ["reason"],
            registry=r,
        )
        for reason in DROP_REASONS:
            self.samples_dropped.labels(reason)
        self.tokens = Counter(
            "clawrl_trainer_tokens_total", "Prompt + response tokens trained.", registry=r
        )
        self.sample_latency = Histogram(
            "clawrl_trainer_sample_latency_seconds",
            "From a sample's XADD to the end of the step that trained it.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.staleness = Histogram(
            "clawrl_trainer_sample_staleness_versions",
            "Policy versions between a trained sample's sampling policy and the trainer's.",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )

    def _tenants(self, r: CollectorRegistry) -> None:
        """Per tenant: steps, samples, rewards, staleness, versions, resets."""
        # Per-tenant mode; the tenant label is bounded by tenants.max_adapters (+ "shared").
        self.tenant_steps = Counter(
            "clawrl_trainer_tenant_steps_total",
            "Steps taken per adapter in tenants.mode = per_tenant (tenant: its id, shared for "
            "the shared policy): the fair order across tenants, counted.",
            ["tenant"],
            registry=r,
        )
        self.tenant_samples = Counter(
            "clawrl_trainer_tenant_samples_total",
            "Samples trained per adapter in tenants.mode = per_tenant (tenant: its id, shared).",
            ["tenant"],
            registry=r,
        )
        self.tenant_reward = Gauge(
            "clawrl_trainer_tenant_reward_mean",
            "Mean reward of the samples of each adapter's last step (per_tenant mode).",
            ["tenant"],
            registry=r,
        )
        self.tenant_staleness = Gauge(
            "clawrl_trainer_tenant_staleness_mean",
            "Mean versions of its own adapter between each adapter's last step's samples and "
            "that adapter (per_tenant mode).",
            ["tenant"],
            registry=r,
        )
        self.tenant_version = Gauge(
            "clawrl_trainer_tenant_policy_version",
            "The last exported version of each tenant's adapter.",
            ["tenant"],
            registry=r,
        )
        self.tenant_overflow = Counter(
            "clawrl_trainer_tenant_overflow_samples_total",
            "Samples of tenants selected for an adapter that found no room (tenants.max_adapters "
            "reached): trained into the shared policy instead.",
            registry=r,
        )
        self.tenant_resets = Counter(
            "clawrl_trainer_tenant_resets_total",
            "Requests to reset or remove a tenant's adapter (clawrl-trainer tenants reset|remove),"
            " by outcome: reset (its adapter dropped, its slot freed: a new one starts from the "
            "shared policy), removed (the same, and no adapter again until a reset), no_adapter "
            "(a reset of a tenant that has none), malformed.",
            ["outcome"],
            registry=r,
        )

    def _steps(self, r: CollectorRegistry) -> None:
        """The optimizer steps: their phases, figures, versions and failures."""
        self.steps = Counter("clawrl_trainer_steps_total", "Optimizer steps taken.", registry=r)
        self.step_seconds = Histogram(
            "clawrl_trainer_step_duration_seconds",
            "Time of one step, by phase (logprobs, forward_backward, optimizer, checkpoint, "
            "export, total).",
            ["phase"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        # Every phase from 0: a series born at its first step is first scraped with that step
        # already counted, and a rate over it misses the step (the Step time panel stayed empty).
        for phase in STEP_PHASES:
            self.step_seconds.labels(phase)
        self.policy_version = Gauge(
            "clawrl_trainer_policy_version", "Latest policy version exported.", registry=r
        )
        self.step = Gauge("clawrl_trainer_step", "Optimizer steps since the start.", registry=r)
        self.step_figures = {
            name: Gauge(f"clawrl_trainer_{name}", text, registry=r)
            for name, text in STEP_GAUGES.items()
        }
        self.checkpoint_failures = Counter(
            "clawrl_trainer_checkpoint_failures_total",
            "States or exports that could not be written (the trainer stops; the step's entries "
            "stay pending and are trained again after the restart).",
            registry=r,
        )
        self.redis_errors = Counter(
            "clawrl_trainer_redis_errors_total",
            "Redis calls that failed, by stage (resume: joining the consumer group and "
            "re-announcing at start-up; intake: reading a batch; step, export, commit, "
            "announce, drop: a step's own calls). Each is made again after a pause; nothing "
            "read is lost and the backend keeps its model.",
            ["stage"],
            registry=r,
        )
        self.step_failures = Counter(
            "clawrl_trainer_step_failures_total",
            "Batches the backend failed to train (dead-lettered with the error).",
            registry=r,
        )
        self.batches_skipped = Counter(
            "clawrl_trainer_batches_skipped_total",
            "Batches that took no step and made no version, by reason (no_signal: every "
            "advantage 0 and no distillation term; their samples count as dropped, no_signal).",
            ["reason"],
            registry=r,
        )

    def record_step(self, figures: dict[str, float]) -> None:
        for name, gauge in self.step_figures.items():
            if name in figures:
                gauge.set(figures[name])

    def record_tenant_step(self, adapter: str, samples: int, figures: dict[str, float]) -> None:
        """Per-tenant mode: one step of `adapter` (a tenant's id, or "" for the shared policy)."""
        tenant = tenant_label(adapter)
        self.tenant_steps.labels(tenant).inc()
        self.tenant_samples.labels(tenant).inc(samples)
        if "reward_mean" in figures:
            self.tenant_reward.labels(tenant).set(figures["reward_mean"])
        if "staleness_mean" in figures:
            self.tenant_staleness.labels(tenant).set(figures["staleness_mean"])
