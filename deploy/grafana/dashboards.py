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


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""


def rate(metric: str, by: str = "", match: str = "") -> str:
    """Per-second rate of a counter, summed (by the given labels)."""
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(rate({metric}{match}{RATE}))"


def quantile(q: float, histogram: str, by: str = "", match: str = "") -> str:
    """The q-quantile of a histogram over the rate window (by the given labels)."""
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket{match}{RATE})))"


def quantiles(histogram: str, by: str = "", match: str = "", legend: str = "") -> tuple:
    prefix = f"{legend} " if legend else ""
    return tuple(
        (quantile(q, histogram, by, match), f"{prefix}p{round(q * 100)}") for q in (0.5, 0.99)
    )


CHAT = '{route="/v1/chat/completions"}'
GC_PAUSES = "clawrl_gateway_gc_pause_seconds_total"
SERVER_ERRORS = '{status=~"5.."}'
ACCEPTED = '{result="accepted"}'

SERVING = [
    Panel(
        "Requests per second",
        "reqps",
        ((rate("clawrl_gateway_requests_total", "route, status"), "{{route}} {{status}}"),),
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
    ),
    Panel(
        "Chat completion latency",
        "s",
        quantiles("clawrl_gateway_request_duration_seconds", match=CHAT),
        "Request to full response, streams included.",
    ),
    Panel(
        "Time to first token (streaming)",
        "s",
        quantiles("clawrl_gateway_time_to_first_token_seconds"),
    ),
    Panel(
        "Tokens per second",
        "short",
        (
            (rate("clawrl_gateway_prompt_tokens_total"), "prompt"),
            (rate("clawrl_gateway_completion_tokens_total"), "completion"),
        ),
    ),
    Panel(
        "Generations in flight",
        "short",
        (
            ("sum by (job) (clawrl_gateway_in_flight_requests)", "in flight"),
            ("sum by (job) (clawrl_gateway_held_requests)", "held (paused)"),
        ),
    ),
    Panel(
        "Active sessions",
        "short",
        (("max(clawrl_gateway_active_sessions)", "sessions"),),
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
            ("max(clawrl_gateway_paused)", "paused"),
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
        (("max by (job) (clawrl_gateway_policy_version)", "version"),),
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
            ("sum by (job) (sglang:num_running_reqs)", "{{job}} running"),
            ("sum by (job) (sglang:num_queue_reqs)", "{{job}} queued"),
        ),
    ),
    Panel(
        "Token throughput",
        "short",
        (
            (rate("sglang:generation_tokens_total", "job"), "{{job}} generated/s"),
            (rate("sglang:prompt_tokens_total", "job"), "{{job}} prompt/s"),
        ),
    ),
    Panel(
        "Finished requests per second",
        "reqps",
        ((rate("sglang:e2e_request_latency_seconds_count", "job"), "{{job}}"),),
    ),
    Panel(
        "Time to first token",
        "s",
        quantiles("sglang:time_to_first_token_seconds", "job", legend="{{job}}"),
    ),
    Panel(
        "End-to-end request latency",
        "s",
        quantiles("sglang:e2e_request_latency_seconds", "job", legend="{{job}}"),
    ),
    Panel(
        "Inter-token latency",
        "s",
        quantiles("sglang:inter_token_latency_seconds", "job", legend="{{job}}"),
    ),
    Panel(
        "KV cache usage",
        "percentunit",
        (("max by (job) (sglang:token_usage)", "{{job}}"),),
    ),
    Panel(
        "Tokens in the KV cache",
        "short",
        (("sum by (job) (sglang:num_used_tokens)", "{{job}}"),),
    ),
    Panel(
        "Prefix cache hit rate",
        "percentunit",
        (("max by (job) (sglang:cache_hit_rate)", "{{job}}"),),
    ),
    Panel(
        "Generation throughput (engine's own)",
        "short",
        (("sum by (job) (sglang:gen_throughput)", "{{job}} token/s"),),
    ),
]

JUDGE = [
    Panel(
        "Turns judged",
        "ops",
        ((f"{rate('clawrl_judge_turns_total', 'outcome')} or vector(0)", "{{outcome}}"),),
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
                "sum(rate(clawrl_judge_vote_agreement_ratio_sum[$__rate_interval]))"
                " / sum(rate(clawrl_judge_vote_agreement_ratio_count[$__rate_interval]))",
                "mean share agreeing with the majority",
            ),
        ),
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
    ),
    Panel(
        "Lag",
        "short",
        (
            ("max(clawrl_judge_consumer_lag_entries)", "not yet delivered"),
            ("max(clawrl_judge_pending_entries)", "pending (unacknowledged)"),
            ("sum(clawrl_judge_in_flight_turns)", "in flight"),
        ),
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
    ),
]

LEARNING = [
    Panel(
        "Reward",
        "short",
        (("max(clawrl_trainer_reward_mean)", "mean reward of the last step"),),
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
            ("max(clawrl_trainer_loss)", "loss"),
            ("max(clawrl_trainer_pg_loss)", "policy-gradient loss"),
        ),
    ),
    Panel(
        "KL",
        "short",
        (
            ("max(clawrl_trainer_kl_ref)", "KL to reference"),
            ("max(clawrl_trainer_approx_kl_old)", "approx KL to the sampling policy"),
        ),
    ),
    Panel(
        "Clip fraction",
        "percentunit",
        (
            ("max(clawrl_trainer_clip_frac)", "PPO-clipped tokens"),
            ("max(clawrl_trainer_tis_clip_frac)", "TIS weight truncated at the cap"),
        ),
        "PPO's clip acts on pi / pi_old, which is 1 at each batch's one optimizer step; stale "
        "samples are corrected by the TIS weight min(pi_old / pi_rollout, ppo.tis_cap).",
    ),
    Panel(
        "Off-policy ratio",
        "short",
        (
            ("max(clawrl_trainer_ratio_mean)", "mean pi_old / pi_rollout"),
            ("max(clawrl_trainer_ratio_max)", "max pi_old / pi_rollout"),
        ),
        "How much likelier the trainer's weights make each trained token than the engine that "
        "sampled it did (1 on-policy); per step, over trained tokens.",
    ),
    Panel(
        "Policy version",
        "none",
        (
            ("max(clawrl_trainer_policy_version)", "exported by the trainer"),
            ("min(clawrl_gateway_policy_version)", "served by the gateway"),
        ),
    ),
    Panel(
        "Staleness of trained samples",
        "none",
        (
            *quantiles("clawrl_trainer_sample_staleness_versions", legend="versions behind"),
            (
                "sum(rate(clawrl_trainer_sample_staleness_versions_sum[$__rate_interval]))"
                " / sum(rate(clawrl_trainer_sample_staleness_versions_count[$__rate_interval]))",
                "mean",
            ),
            ("max(clawrl_trainer_staleness_mean)", "mean of the last step"),
            ("max(clawrl_trainer_staleness_max)", "max of the last step"),
        ),
    ),
    Panel(
        "Samples consumed and dropped",
        "ops",
        (
            (f"{rate('clawrl_trainer_samples_consumed_total', 'kind')} or vector(0)", "{{kind}}"),
            (rate("clawrl_trainer_samples_dropped_total", "reason"), "dropped: {{reason}}"),
        ),
    ),
    Panel(
        "Step time",
        "s",
        ((quantile(0.5, "clawrl_trainer_step_duration_seconds", "phase"), "{{phase}} p50"),),
    ),
    Panel(
        "Training throughput",
        "short",
        (
            (rate("clawrl_trainer_tokens_total"), "tokens/s (averaged)"),
            ("max(clawrl_trainer_tokens_per_second)", "tokens/s (last step)"),
            (rate("clawrl_trainer_steps_total"), "steps/s"),
        ),
    ),
    Panel(
        "Entropy and gradient norm",
        "short",
        (
            ("max(clawrl_trainer_entropy)", "entropy (nats)"),
            ("max(clawrl_trainer_grad_norm)", "grad norm before clipping"),
        ),
    ),
    Panel(
        "Advantages",
        "short",
        (
            ("max(clawrl_trainer_advantage_mean)", "mean"),
            ("max(clawrl_trainer_advantage_std)", "std"),
        ),
    ),
    Panel(
        "Sample latency (written -> trained)",
        "s",
        quantiles("clawrl_trainer_sample_latency_seconds"),
    ),
    Panel(
        "Weight syncs",
        "short",
        (
            (f"{rate('clawrl_weight_sync_syncs_total', 'outcome')} or vector(0)", "{{outcome}}/s"),
            (quantile(0.99, "clawrl_weight_sync_pause_duration_seconds"), "pause p99 (s)"),
            (quantile(0.99, "clawrl_weight_sync_load_duration_seconds"), "load p99 (s)"),
            ("max(clawrl_weight_sync_announced_version)", "announced version"),
        ),
        "One sync per new policy version: how long the gateways were paused and the engines "
        "loaded.",
    ),
    Panel(
        "Checkpoint failures",
        "short",
        (
            (
                "sum(increase(clawrl_trainer_checkpoint_failures_total[$__rate_interval]))",
                "failures",
            ),
        ),
        "A failed checkpoint or export stops the trainer; its entries stay pending.",
    ),
]

DASHBOARDS = {
    "serving": ("clawrl / serving", SERVING),
    "engines": ("clawrl / engines (SGLang)", ENGINES),
    "judge": ("clawrl / judge", JUDGE),
    "learning": ("clawrl / learning", LEARNING),
}


def panel_json(panel: Panel, index: int) -> dict:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": (index % 2) * 12, "y": (index // 2) * 8},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(panel.queries)
        ],
    }


def dashboard_json(name: str, title: str, panels: list[Panel]) -> dict:
    return {
        "uid": f"clawrl-{name}",
        "title": title,
        "tags": ["clawrl"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "panels": [panel_json(panel, i) for i, panel in enumerate(panels)],
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
