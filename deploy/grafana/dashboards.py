"""The Grafana dashboards as code: `python deploy/grafana/dashboards.py` writes
helm/clawrl/dashboards/<name>.json, which the chart ships as ConfigMaps and a local Grafana
imports. Panels query only metrics the services export (tests/helm/test_dashboards.py checks the
names against the services' registries and proves the queries against a live Prometheus).

A panel is a title, a unit and its queries (PromQL, legend). `$__rate_interval` is Grafana's;
series are split by `job` (the scrape job: one per service locally, the Service name on
Kubernetes). Labelled counters that only appear on their first event are written `... or
vector(0)` so a quiet failure panel shows 0 rather than nothing.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "helm" / "clawrl" / "dashboards"
RATE = "[$__rate_interval]"
# Every selector's scope: the namespace, the release (its pods' names start with the release's
# object prefix, `<release>-clawrl` unless fullnameOverride) and the pods picked (drill-down).
SCOPE = 'namespace="$namespace", pod=~"$release-.+", pod=~"$pod"'


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    threshold: float | None = None  # drawn as a red line: past it, something needs attention


@dataclass(frozen=True)
class Row:
    """A row header: the panels after it, up to the next row, are its panels."""

    title: str


def sel(metric: str, match: str = "") -> str:
    """A selector of `metric` scoped to the dashboard's namespace, release and pods; `match`
    (written `{label="value"}`) adds matchers."""
    extra = match.strip("{}")
    return f"{metric}{{{SCOPE}{', ' + extra if extra else ''}}}"


def rate(metric: str, by: str = "", match: str = "") -> str:
    """Per-second rate of a counter, summed (by the given labels)."""
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(rate({sel(metric, match)}{RATE}))"


def quantile(q: float, histogram: str, by: str = "", match: str = "") -> str:
    """The q-quantile of a histogram over the rate window (by the given labels)."""
    labels = f"le, {by}" if by else "le"
    buckets = sel(f"{histogram}_bucket", match)
    return f"histogram_quantile({q}, sum by ({labels}) (rate({buckets}{RATE})))"


def quantiles(histogram: str, by: str = "", match: str = "", legend: str = "") -> tuple:
    prefix = f"{legend} " if legend else ""
    return tuple(
        (quantile(q, histogram, by, match), f"{prefix}p{round(q * 100)}") for q in (0.5, 0.99)
    )


GC_PAUSES = "clawrl_gateway_gc_pause_seconds_total"
SERVER_ERRORS = '{status=~"5.."}'
ACCEPTED = '{result="accepted"}'

SERVING = [
    Panel(
        "Requests per second",
        "reqps",
        ((rate("clawrl_gateway_requests_total", "route, status"), "{{route}} {{status}}"),),
        "Requests the gateway answered, by route and HTTP status.",
    ),
    Panel(
        "Error ratio (5xx)",
        "percentunit",
        (
            (
                f"({rate('clawrl_gateway_requests_total', match=SERVER_ERRORS)} or vector(0))"
                f" / {rate('clawrl_gateway_requests_total')}",
                "5xx share",
            ),
        ),
        "Share of the gateway's answers that were server errors (5xx); the line marks 1 %, the "
        "ClawrlGateway5xxHigh alert's threshold.",
        threshold=0.01,
    ),
    Panel(
        "Request latency by route",
        "s",
        quantiles("clawrl_gateway_request_duration_seconds", "route", legend="{{route}}"),
        "Request to full response, streams included, for each API route: chat completions, "
        "responses, messages (and feedback, models).",
    ),
    Panel(
        "Time to first token (streaming)",
        "s",
        quantiles("clawrl_gateway_time_to_first_token_seconds"),
        "Request to the first streamed token, as the client sees it (queueing and prefill "
        "included).",
    ),
    Panel(
        "Tokens per second",
        "short",
        (
            (rate("clawrl_gateway_prompt_tokens_total"), "prompt"),
            (rate("clawrl_gateway_completion_tokens_total"), "completion"),
        ),
        "Prompt and completion tokens the gateway sent to and received from the policy engine.",
    ),
    Panel(
        "Generations in flight",
        "short",
        (
            (f"sum by (job) ({sel('clawrl_gateway_in_flight_requests')})", "in flight"),
            (f"sum by (job) ({sel('clawrl_gateway_held_requests')})", "held (paused)"),
        ),
        "Generations running now, and requests held while the gateway is paused for a weight sync.",
    ),
    Panel(
        "Active sessions",
        "short",
        ((f"max({sel('clawrl_gateway_active_sessions')})", "sessions"),),
        "Sessions with a request within the idle timeout (all replicas, from Redis).",
    ),
    Panel(
        "Turns",
        "ops",
        (
            (rate("clawrl_gateway_turns_recorded_total"), "recorded"),
            (
                f"{rate('clawrl_gateway_turns_finalized_total', 'reason')} or vector(0)",
                "finalised: {{reason}}",
            ),
        ),
        "Main turns recorded, and turns put on clawrl:turns by reason (next state, idle, ...).",
    ),
    Panel(
        "Pause windows",
        "short",
        (
            (f"max({sel('clawrl_gateway_paused')})", "paused"),
            (rate("clawrl_gateway_hold_duration_seconds_count"), "held requests released/s"),
            (rate("clawrl_gateway_hold_timeouts_total"), "hold timeouts/s"),
            (rate("clawrl_gateway_pause_lease_expiries_total"), "pause leases expired/s"),
            (rate("clawrl_gateway_pause_refusals_total"), "pauses refused/s"),
        ),
        "1 while the gateway is paused for a weight sync; an expired lease means a sync job "
        "died mid-pause and the gateway resumed by itself.",
    ),
    Panel(
        "Policy version served",
        "none",
        ((f"max by (job) ({sel('clawrl_gateway_policy_version')})", "version"),),
        "The policy version each gateway serves (it changes at each weight sync).",
    ),
    Panel(
        "Failures",
        "ops",
        (
            (
                f"{rate('clawrl_gateway_engine_errors_total', 'kind')} or vector(0)",
                "engine: {{kind}}",
            ),
            (
                f"{rate('clawrl_gateway_recording_failures_total', 'stage')} or vector(0)",
                "recording: {{stage}}",
            ),
            (rate("clawrl_gateway_history_mismatches_total"), "history mismatches"),
        ),
        "Serving goes on when recording fails; every failure is counted here.",
    ),
    Panel(
        "Explicit feedback",
        "ops",
        ((f"{rate('clawrl_gateway_feedback_total', 'outcome')} or vector(0)", "{{outcome}}"),),
        "POST /v1/feedback by outcome: accepted (the judge merges it into the turn's sample), "
        "late (the sample was already published: audited only), duplicate, not_found, invalid, "
        "conflict, unavailable (Redis failed).",
    ),
    Panel(
        "Garbage-collection pauses",
        "percentunit",
        ((rate(GC_PAUSES, "job, generation"), "{{job}} generation {{generation}}"),),
        "Share of the time the gateway's collector stopped every request. Start-up state is "
        "frozen out of collection, so full (generation 2) collections stay short.",
    ),
]

ENGINES = [
    Panel(
        "Requests running / queued",
        "short",
        (
            (f"sum by (job) ({sel('sglang:num_running_reqs')})", "{{job}} running"),
            (f"sum by (job) ({sel('sglang:num_queue_reqs')})", "{{job}} queued"),
        ),
        "Requests each engine is decoding, and those waiting for room in its batch or KV cache.",
    ),
    Panel(
        "Token throughput",
        "short",
        (
            (rate("sglang:generation_tokens_total", "job"), "{{job}} generated/s"),
            (rate("sglang:prompt_tokens_total", "job"), "{{job}} prompt/s"),
        ),
        "Tokens each engine generated and prompt tokens it took in, per second.",
    ),
    Panel(
        "Finished requests per second",
        "reqps",
        ((rate("sglang:e2e_request_latency_seconds_count", "job"), "{{job}}"),),
        "Requests each engine finished.",
    ),
    Panel(
        "Time to first token",
        "s",
        quantiles("sglang:time_to_first_token_seconds", "job", legend="{{job}}"),
        "Engine-side time to the first token (queueing and prefill).",
    ),
    Panel(
        "End-to-end request latency",
        "s",
        quantiles("sglang:e2e_request_latency_seconds", "job", legend="{{job}}"),
        "Engine-side time from arrival to the last token.",
    ),
    Panel(
        "Inter-token latency",
        "s",
        quantiles("sglang:inter_token_latency_seconds", "job", legend="{{job}}"),
        "Time between two decoded tokens of one request (decode speed under load).",
    ),
    Panel(
        "KV cache usage",
        "percentunit",
        ((f"max by (job) ({sel('sglang:token_usage')})", "{{job}}"),),
        "Share of each engine's KV cache in use; past the line (90 %) requests queue or are "
        "retracted (ClawrlEngineSaturated).",
        threshold=0.9,
    ),
    Panel(
        "Tokens in the KV cache",
        "short",
        ((f"sum by (job) ({sel('sglang:num_used_tokens')})", "{{job}}"),),
        "Tokens each engine holds in its KV cache (running requests and cached prefixes).",
    ),
    Panel(
        "Prefix cache hit rate",
        "percentunit",
        ((f"max by (job) ({sel('sglang:cache_hit_rate')})", "{{job}}"),),
        "Share of prompt tokens found in the prefix (radix) cache: multi-turn sessions reuse "
        "their history.",
    ),
    Panel(
        "Generation throughput (engine's own)",
        "short",
        ((f"sum by (job) ({sel('sglang:gen_throughput')})", "{{job}} token/s"),),
        "Decode throughput the engine itself reports over its last logging interval.",
    ),
]

JUDGE = [
    Panel(
        "Turns judged",
        "ops",
        ((f"{rate('clawrl_judge_turns_total', 'outcome')} or vector(0)", "{{outcome}}"),),
        "Turns the judges finished, by outcome.",
    ),
    Panel(
        "Samples published (score mix)",
        "ops",
        (
            (
                f"{rate('clawrl_judge_samples_total', 'kind, score')} or vector(0)",
                "{{kind}} {{score}}",
            ),
        ),
        "Training samples the judges put on the samples stream, by kind (rl, opd, combined) and "
        "score sign.",
    ),
    Panel(
        "Votes",
        "ops",
        (
            (
                f"{rate('clawrl_judge_votes_total', 'kind, result')} or vector(0)",
                "{{kind}} {{result}}",
            ),
        ),
        "valid: a parsable verdict; invalid: none; failed: the backend refused.",
    ),
    Panel(
        "Vote agreement",
        "percentunit",
        (
            (
                f"{rate('clawrl_judge_vote_agreement_ratio_sum')}"
                f" / {rate('clawrl_judge_vote_agreement_ratio_count')}",
                "mean share agreeing with the majority",
            ),
        ),
        "Mean share of a turn's PRM votes that agree with the majority (low: the judge is unsure).",
    ),
    Panel(
        "Hint acceptance",
        "percentunit",
        (
            (
                f"({rate('clawrl_judge_hints_total', match=ACCEPTED)} or vector(0))"
                f" / {rate('clawrl_judge_hints_total')}",
                "accepted",
            ),
        ),
        "Share of hint selections that gave a usable hindsight hint (OPD signal).",
    ),
    Panel(
        "Latency",
        "s",
        (
            *quantiles("clawrl_judge_turn_duration_seconds", legend="turn"),
            (quantile(0.99, "clawrl_judge_vote_duration_seconds", "kind"), "votes {{kind}} p99"),
            (quantile(0.99, "clawrl_judge_teacher_duration_seconds"), "teacher p99"),
        ),
        "Time to judge one turn, one vote round and one teacher pass.",
    ),
    Panel(
        "Dead letters and masked samples",
        "ops",
        (
            (
                f"{rate('clawrl_judge_dead_lettered_total', 'reason')} or vector(0)",
                "dead: {{reason}}",
            ),
            (
                f"{rate('clawrl_judge_masked_samples_total', 'reason')} or vector(0)",
                "masked: {{reason}}",
            ),
        ),
        "Turns given up on (dead-lettered) and samples published with their loss masked, by "
        "reason.",
    ),
    Panel(
        "Lag",
        "short",
        (
            (f"max({sel('clawrl_judge_consumer_lag_entries')})", "not yet delivered"),
            (f"max({sel('clawrl_judge_pending_entries')})", "pending (unacknowledged)"),
            (f"sum({sel('clawrl_judge_in_flight_turns')})", "in flight"),
        ),
        "Turns on the stream not yet delivered to a judge, delivered but not acknowledged, and "
        "being judged now. Growing lag: the judges fall behind (ClawrlJudgeLagGrowing).",
    ),
    Panel(
        "Errors and retries",
        "ops",
        (
            (f"{rate('clawrl_judge_errors_total', 'stage')} or vector(0)", "error: {{stage}}"),
            (rate("clawrl_judge_engine_retries_total"), "engine unavailable, retried"),
            (
                f"{rate('clawrl_judge_prompts_shortened_total', 'kind')} or vector(0)",
                "shortened: {{kind}}",
            ),
        ),
        "Judge errors by stage, engine calls retried while the judge engine was unavailable, "
        "prompts shortened to fit.",
    ),
    Panel(
        "Explicit feedback merged",
        "ops",
        ((f"{rate('clawrl_judge_feedback_total', 'use')} or vector(0)", "{{use}}"),),
        "How the judges used explicit feedback: reward_override, reward_weighted, hint (a "
        "comment as the hindsight hint), reward_unused (opd trains on the teacher only), late "
        "(arrived while its turn was judged: audited, not merged).",
    ),
]

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


def dcgm(metric: str) -> str:
    """A DCGM exporter gauge of the scoped pods, labelled with the GPU's pod as `pod`.
    dcgm-exporter names the pod using a GPU in `namespace` and `pod`; Prometheus renames them
    `exported_namespace` and `exported_pod` when it keeps the exporter's own target labels
    (honorLabels false, the default of NVIDIA's charts): both spellings are read."""
    exported = SCOPE.replace("namespace=", "exported_namespace=").replace("pod=", "exported_pod=")
    renamed = f'label_replace({metric}{{{exported}}}, "pod", "$1", "exported_pod", "(.+)")'
    return f"({renamed} or {sel(metric)})"


OOM_KILLED = '{reason="OOMKilled"}'
CONTAINERS = '{container!=""}'  # not the pod-level cgroup's series (they would count twice)
MEMORY_LIMIT = '{resource="memory"}'

# Kubernetes (kube-state-metrics, the kubelet's cAdvisor), GPUs (NVIDIA's dcgm-exporter), Redis
# (the chart's redis_exporter sidecar, and the judge's own reading), Ray (the trainer's nodes).
CLUSTER = [
    Panel(
        "Container restarts",
        "short",
        (
            (
                f"sum by (pod) (increase({sel('kube_pod_container_status_restarts_total')}{RATE}))",
                "{{pod}}",
            ),
        ),
        "Container restarts per pod over the window (kube-state-metrics). An engine or trainer "
        "that restarts reloads its weights; see OOM kills beside it.",
        threshold=1,
    ),
    Panel(
        "OOM kills",
        "short",
        (
            (
                "sum by (pod) ("
                f"{sel('kube_pod_container_status_last_terminated_reason', OOM_KILLED)})",
                "{{pod}}",
            ),
        ),
        "1 for a pod whose container last ended killed for passing its memory limit "
        "(kube-state-metrics): raise the component's resources.limits.memory.",
        threshold=1,
    ),
    Panel(
        "Memory (working set) and limit",
        "bytes",
        (
            (
                f"sum by (pod) ({sel('container_memory_working_set_bytes', CONTAINERS)})",
                "{{pod}}",
            ),
            (
                f"sum by (pod) ({sel('kube_pod_container_resource_limits', MEMORY_LIMIT)})",
                "{{pod}} limit",
            ),
        ),
        "Memory the kubelet counts against each pod's limit (cAdvisor), and the limit.",
    ),
    Panel(
        "CPU",
        "short",
        (
            (
                f"sum by (pod) (rate({sel('container_cpu_usage_seconds_total', CONTAINERS)}"
                f"{RATE}))",
                "{{pod}}",
            ),
        ),
        "Cores each pod uses (cAdvisor).",
    ),
    Panel(
        "GPU utilisation",
        "percent",
        ((f"avg by (pod) ({dcgm('DCGM_FI_DEV_GPU_UTIL')})", "{{pod}}"),),
        "Mean utilisation of each pod's GPUs (dcgm-exporter): engines, and the trainer's Ray "
        "workers.",
    ),
    Panel(
        "GPU memory used",
        "decmbytes",
        ((f"sum by (pod) ({dcgm('DCGM_FI_DEV_FB_USED')})", "{{pod}}"),),
        "Frame-buffer memory used on each pod's GPUs (dcgm-exporter). SGLang reserves "
        "mem_fraction_static of it at start.",
    ),
    Panel(
        "GPU power and temperature",
        "short",
        (
            (f"sum by (pod) ({dcgm('DCGM_FI_DEV_POWER_USAGE')})", "{{pod}} W"),
            (f"max by (pod) ({dcgm('DCGM_FI_DEV_GPU_TEMP')})", "{{pod}} °C (hottest)"),
        ),
        "Power draw (watts) of each pod's GPUs and the hottest one's temperature.",
    ),
    Panel(
        "GPU XID errors",
        "short",
        ((f"max by (pod) ({dcgm('DCGM_FI_DEV_XID_ERRORS')})", "{{pod}}"),),
        "The last XID error each pod's GPUs reported (0: none): a driver-level GPU fault.",
    ),
    Panel(
        "Redis memory",
        "bytes",
        (
            (f"max({sel('clawrl_judge_redis_used_memory_bytes')})", "used (judge's reading)"),
            (f"max({sel('clawrl_judge_redis_maxmemory_bytes')} > 0)", "maxmemory"),
            (f"max({sel('redis_memory_used_bytes')})", "used (redis_exporter)"),
        ),
        "Redis refuses writes at maxmemory (noeviction): turns are then spooled or lost and "
        "the judge stops (ClawrlRedisMemoryHigh).",
    ),
    Panel(
        "Redis streams",
        "short",
        (
            (f"max by (stream) ({sel('redis_stream_length')})", "{{stream}} length"),
            (
                f"max by (stream, group) ({sel('redis_stream_group_lag')})",
                "{{stream}} {{group}} not delivered",
            ),
            (
                f"max by (stream, group) ({sel('redis_stream_group_messages_pending')})",
                "{{stream}} {{group}} pending",
            ),
        ),
        "Entries on each clawrl stream, and per consumer group those not yet delivered and "
        "those delivered but not acknowledged (redis_exporter sidecar, redis.exporter).",
    ),
    Panel(
        "Ray nodes",
        "percent",
        (
            (f"avg by (pod) ({sel('ray_node_cpu_utilization')})", "{{pod}} CPU"),
            (f"avg by (pod) ({sel('ray_node_gpus_utilization')})", "{{pod}} GPU"),
        ),
        "CPU and GPU utilisation of the trainer's Ray nodes as Ray reports them.",
    ),
    Panel(
        "Ray memory",
        "bytes",
        (
            (f"sum by (pod) ({sel('ray_node_mem_used')})", "{{pod}} memory"),
            (f"sum by (pod) ({sel('ray_object_store_memory')})", "{{pod}} object store"),
        ),
        "Memory used on each Ray node, and by Ray's object store (the trainer's batches).",
    ),
]

DASHBOARDS = {
    "serving": ("clawrl / serving", SERVING),
    "engines": ("clawrl / engines (SGLang)", ENGINES),
    "judge": ("clawrl / judge", JUDGE),
    "learning": ("clawrl / learning", [*LEARNING, Row("Tenants"), *TENANTS]),
    "cluster": ("clawrl / cluster (pods, GPUs, Redis, Ray)", CLUSTER),
}
PROMETHEUS = {"type": "prometheus", "uid": "${datasource}"}
SYNCS = sel("clawrl_weight_sync_syncs_total")
# Grafana annotations on every dashboard: each weight sync (by outcome) and each change of the
# policy version the gateways serve. A sync counter's outcome appears at its first sync, which
# increase() cannot see (no sample before it): a series new within the minute counts too.
ANNOTATIONS = (
    (
        "Weight syncs",
        "blue",
        f"sum by (outcome) ((increase({SYNCS}[1m]) > 0) or ({SYNCS} unless {SYNCS} offset 1m))",
        "weight sync: {{outcome}}",
    ),
    (
        "Policy version served",
        "green",
        f"max(changes({sel('clawrl_gateway_policy_version')}[1m])) > 0",
        "policy version changed",
    ),
)


def panel_json(panel: Panel, index: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": panel.unit}
    if panel.threshold is not None:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [
                {"color": "green", "value": None},
                {"color": "red", "value": panel.threshold},
            ],
        }
        defaults["custom"] = {"thresholdsStyle": {"mode": "line"}}
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": PROMETHEUS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": PROMETHEUS,
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(panel.queries)
        ],
    }


def layout(items: list[Panel | Row]) -> list[dict]:
    """Panels two per line, 8 high; a row header across the full width starts a new line."""
    placed, y, column = [], 0, 0
    for index, item in enumerate(items):
        if isinstance(item, Row):
            y += 8 if column else 0
            header = {"id": index + 1, "type": "row", "title": item.title, "collapsed": False}
            placed.append({**header, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            y, column = y + 1, 0
            continue
        placed.append(panel_json(item, index, column * 12, y))
        y, column = (y + 8, 0) if column else (y, 1)
    return placed


def query_variable(name: str, label: str, query: str, **extra) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": PROMETHEUS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,  # on time range change: pods come and go
        "current": {},
        "hide": 0,
        "sort": 1,
        "includeAll": False,
        "multi": False,
        **extra,
    }


# The scope's variables. The chart sets namespace and release to its own (and gives each
# release's dashboards their own uid); the pod picker drills down to some pods.
VARIABLES = [
    query_variable("namespace", "Namespace", "label_values(up, namespace)"),
    query_variable(
        "release",
        "Release",
        'label_values(up{namespace="$namespace"}, pod)',
        # The object prefix in the names of the pods of a Deployment of the chart.
        regex="/^(.+)-(?:gateway|judge|judge-engine|policy-engine)(?:-[a-z0-9]+){0,2}$/",
    ),
    query_variable(
        "pod",
        "Pod",
        'label_values(up{namespace="$namespace", pod=~"$release-.+"}, pod)',
        includeAll=True,
        multi=True,
        allValue=".*",
        current={"selected": True, "text": ["All"], "value": ["$__all"]},
    ),
]


# A dashboard with per-tenant panels picks tenants (several or All).
TENANT_VARIABLE = query_variable(
    "tenant",
    "Tenant",
    'label_values(clawrl_trainer_tenant_steps_total{namespace="$namespace", '
    'pod=~"$release-.+"}, tenant)',
    includeAll=True,
    multi=True,
    allValue=".*",
    current={"selected": True, "text": ["All"], "value": ["$__all"]},
)


def dashboard_json(name: str, title: str, panels: list[Panel | Row]) -> dict:
    per_tenant = any(
        "$tenant" in expr for p in panels if isinstance(p, Panel) for expr, _ in p.queries
    )
    return {
        "uid": f"clawrl-{name}",
        "title": title,
        "description": f"clawrl's {name} dashboard, scoped to one namespace and release.",
        "tags": ["clawrl"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {
            "list": [
                {
                    "name": label,
                    "datasource": PROMETHEUS,
                    "enable": True,
                    "iconColor": color,
                    "expr": expr,
                    "step": "30s",
                    "titleFormat": text,
                    "useValueForTime": False,
                }
                for label, color, expr, text in ANNOTATIONS
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                *VARIABLES,
                *([TENANT_VARIABLE] if per_tenant else []),
            ]
        },
        "panels": layout(panels),
    }


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        f"{name}.json": json.dumps(dashboard_json(name, title, panels), indent=2) + "\n"
        for name, (title, panels) in DASHBOARDS.items()
    }


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for file_name, text in render_all().items():
        (OUT / file_name).write_text(text)
        print(OUT / file_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
