"""The learning dashboard: the trainer's steps and weight syncs, and a Tenants row for
per-tenant adapters."""

from __future__ import annotations

from deploy.grafana.dashboards.panels import RATE, Panel, quantile, quantiles, rate, sel

LEARNING = [
    Panel(
        "Reward",
        "short",
        ((f"max({sel('clawrl_trainer_reward_mean')})", "mean reward of the last step"),),
        "Mean reward of the samples in the trainer's last step.",
    ),
    Panel(
        "Score mix",
        "ops",
        (
            (
                f"{rate('clawrl_judge_samples_total', 'kind, score')} or vector(0)",
                "{{kind}} {{score}}",
            ),
        ),
        "Samples the judge published, by kind (rl, opd, combined) and score sign.",
    ),
    Panel(
        "Loss",
        "short",
        (
            (f"max({sel('clawrl_trainer_loss')})", "loss"),
            (f"max({sel('clawrl_trainer_pg_loss')})", "policy-gradient loss"),
        ),
        "Total and policy-gradient loss of the last step.",
    ),
    Panel(
        "KL",
        "short",
        (
            (f"max({sel('clawrl_trainer_kl_ref')})", "KL to reference"),
            (f"max({sel('clawrl_trainer_approx_kl_old')})", "approx KL to the sampling policy"),
        ),
        "KL to the frozen reference model (penalised by ppo.kl_coef) and approximate KL to the "
        "policy that sampled.",
    ),
    Panel(
        "Clip fraction",
        "percentunit",
        (
            (f"max({sel('clawrl_trainer_clip_frac')})", "PPO-clipped tokens"),
            (f"max({sel('clawrl_trainer_tis_clip_frac')})", "TIS weight truncated at the cap"),
        ),
        "PPO's clip acts on pi / pi_old, which is 1 at each batch's one optimizer step; stale "
        "samples are corrected by the TIS weight min(pi_old / pi_rollout, ppo.tis_cap).",
    ),
    Panel(
        "Off-policy ratio",
        "short",
        (
            (f"max({sel('clawrl_trainer_ratio_mean')})", "mean pi_old / pi_rollout"),
            (f"max({sel('clawrl_trainer_ratio_max')})", "max pi_old / pi_rollout"),
        ),
        "How much likelier the trainer's weights make each trained token than the engine that "
        "sampled it did (1 on-policy); per step, over trained tokens.",
    ),
    Panel(
        "Policy version",
        "none",
        (
            (f"max({sel('clawrl_trainer_policy_version')})", "exported by the trainer"),
            (f"min({sel('clawrl_gateway_policy_version')})", "served by the gateway"),
        ),
        "Newest version the trainer exported and the oldest one a gateway serves; a growing gap "
        "means syncs fall behind (ClawrlPolicyVersionLag).",
    ),
    Panel(
        "Staleness of trained samples",
        "none",
        (
            *quantiles("clawrl_trainer_sample_staleness_versions", legend="versions behind"),
            (
                f"{rate('clawrl_trainer_sample_staleness_versions_sum')}"
                f" / {rate('clawrl_trainer_sample_staleness_versions_count')}",
                "mean",
            ),
            (f"max({sel('clawrl_trainer_staleness_mean')})", "mean of the last step"),
            (f"max({sel('clawrl_trainer_staleness_max')})", "max of the last step"),
        ),
        "How many versions behind the trainer's weights the policy that sampled each trained "
        "sample was.",
    ),
    Panel(
        "Samples consumed and dropped",
        "ops",
        (
            (f"{rate('clawrl_trainer_samples_consumed_total', 'kind')} or vector(0)", "{{kind}}"),
            (rate("clawrl_trainer_samples_dropped_total", "reason"), "dropped: {{reason}}"),
            (rate("clawrl_trainer_batches_skipped_total", "reason"), "batches skipped: {{reason}}"),
        ),
        "Samples the trainer trained on, by kind, and those it dropped, by reason (too stale, too"
        " long, ...); batches that took no step (no_signal: every advantage 0).",
    ),
    Panel(
        "Step time",
        "s",
        ((quantile(0.5, "clawrl_trainer_step_duration_seconds", "phase"), "{{phase}} p50"),),
        "Median time of each phase of a training step.",
    ),
    Panel(
        "Training throughput",
        "short",
        (
            (rate("clawrl_trainer_tokens_total"), "tokens/s (averaged)"),
            (f"max({sel('clawrl_trainer_tokens_per_second')})", "tokens/s (last step)"),
            (rate("clawrl_trainer_steps_total"), "steps/s"),
        ),
        "Tokens trained per second (averaged and last step) and optimizer steps per second.",
    ),
    Panel(
        "Entropy and gradient norm",
        "short",
        (
            (f"max({sel('clawrl_trainer_entropy')})", "entropy (nats)"),
            (f"max({sel('clawrl_trainer_grad_norm')})", "grad norm before clipping"),
        ),
        "Mean token entropy of the policy on trained tokens, and the gradient norm before "
        "clipping.",
    ),
    Panel(
        "Advantages",
        "short",
        (
            (f"max({sel('clawrl_trainer_advantage_mean')})", "mean"),
            (f"max({sel('clawrl_trainer_advantage_std')})", "std"),
        ),
        "Mean and standard deviation of the advantages of the last step's tokens.",
    ),
    Panel(
        "Sample latency (written -> trained)",
        "s",
        quantiles("clawrl_trainer_sample_latency_seconds"),
        "Time from a sample's publication by the judge to its training step.",
    ),
    Panel(
        "Weight syncs",
        "short",
        (
            (f"{rate('clawrl_weight_sync_syncs_total', 'outcome')} or vector(0)", "{{outcome}}/s"),
            (quantile(0.99, "clawrl_weight_sync_pause_duration_seconds"), "pause p99 (s)"),
            (quantile(0.99, "clawrl_weight_sync_load_duration_seconds"), "load p99 (s)"),
            (f"max({sel('clawrl_weight_sync_announced_version')})", "announced version"),
        ),
        "One sync per new policy version: how long the gateways were paused and the engines "
        "loaded.",
    ),
    Panel(
        "Checkpoint failures",
        "short",
        (
            (
                f"sum(increase({sel('clawrl_trainer_checkpoint_failures_total')}{RATE}))",
                "failures",
            ),
        ),
        "A failed checkpoint or export stops the trainer; its entries stay pending.",
    ),
]

# Per-tenant adapters ([tenants] mode = "per_tenant"): the learning dashboard's Tenants row,
# filtered by the tenant variable. A tenant's label is its id once it owns an adapter; the
# shared policy (and everyone it serves) is "shared".
TENANT = '{tenant=~"$tenant"}'
TENANTS = [
    Panel(
        "Reward per tenant",
        "short",
        ((f"max by (tenant) ({sel('clawrl_trainer_tenant_reward_mean', TENANT)})", "{{tenant}}"),),
        "Mean reward of the samples of each tenant's last step: each adapter learns from its "
        "own tenant's turns only.",
    ),
    Panel(
        "Adapter version per tenant",
        "none",
        (
            (
                f"max by (tenant) ({sel('clawrl_trainer_tenant_policy_version', TENANT)})",
                "{{tenant}} exported",
            ),
            (
                f"min by (tenant) ({sel('clawrl_gateway_tenant_policy_version', TENANT)})",
                "{{tenant}} served",
            ),
        ),
        "Newest version of each tenant's adapter the trainer exported, and the oldest one a "
        "gateway serves that tenant (a gap that grows: that tenant's syncs fall behind).",
    ),
    Panel(
        "Samples and requests per tenant",
        "ops",
        (
            (rate("clawrl_trainer_tenant_samples_total", "tenant", TENANT), "{{tenant}} trained"),
            (rate("clawrl_gateway_tenant_requests_total", "tenant", TENANT), "{{tenant}} served"),
            (rate("clawrl_trainer_tenant_overflow_samples_total"), "over max_adapters (shared)"),
        ),
        "Samples each adapter trained and generations each adapter served, per second; a "
        "tenant without an adapter of its own counts as shared. Overflow: samples of tenants "
        "selected for an adapter that found none free (tenants.max_adapters), trained shared.",
    ),
    Panel(
        "Steps and staleness per tenant",
        "short",
        (
            (rate("clawrl_trainer_tenant_steps_total", "tenant", TENANT), "{{tenant}} steps/s"),
            (
                f"max by (tenant) ({sel('clawrl_trainer_tenant_staleness_mean', TENANT)})",
                "{{tenant}} staleness (versions)",
            ),
        ),
        "Steps per tenant (tenants with a batch take turns: none starves) and the mean "
        "staleness of each tenant's last step, in versions of its own adapter.",
    ),
    Panel(
        "Adapter syncs per tenant",
        "ops",
        (
            (
                f"{rate('clawrl_weight_sync_tenant_syncs_total', 'tenant, outcome', TENANT)}"
                " or vector(0)",
                "{{tenant}} {{outcome}}",
            ),
        ),
        "Syncs of one tenant's adapter (loaded on every engine, switched on every gateway for "
        "that tenant alone, no pause), by outcome.",
    ),
    Panel(
        "Resets and unroutes per tenant",
        "ops",
        (
            (
                f"{rate('clawrl_trainer_tenant_resets_total', 'outcome')} or vector(0)",
                "{{outcome}}",
            ),
            (
                f"{rate('clawrl_weight_sync_tenant_unroutes_total', 'tenant, outcome', TENANT)}"
                " or vector(0)",
                "{{tenant}} unrouted ({{outcome}})",
            ),
        ),
        "Adapters reset or removed (clawrl-trainer tenants reset|remove), and gateways told to "
        "serve a tenant the shared policy again (its adapter released, or the tenant taken out "
        "of allow/pattern). Steady failed unroutes: a gateway still serves a released adapter.",
    ),
    Panel(
        "Adapters on the engines",
        "short",
        (
            (f"sum by (pod) ({sel('clawrl_engine_lora_adapters_resident')})", "{{pod}} resident"),
            (f"sum by (pod) ({sel('clawrl_engine_lora_adapters')})", "{{pod}} loaded"),
        ),
        "Adapters each engine holds ready to batch (at most max_loras_per_batch) and loaded "
        "(registered, in host memory; at most max_loaded_loras).",
    ),
    Panel(
        "Adapter evictions and on-demand loads",
        "ops",
        (
            (
                f"{rate('clawrl_engine_lora_evictions_total', 'pod, level')} or vector(0)",
                "{{pod}} evicted ({{level}})",
            ),
            (rate("clawrl_engine_lora_on_demand_loads_total", "pod"), "{{pod}} loaded on demand"),
            (rate("clawrl_engine_lora_slot_waits_total", "pod"), "{{pod}} waited for a slot"),
        ),
        "Adapters evicted (resident: made room in the batch, kept in host memory; loaded: "
        "unloaded past max_loaded_loras), brought back by a request, and requests that waited "
        "for an adapter slot. Steady evictions: more active tenants than slots.",
    ),
]
