"""The serving dashboard: the gateway's requests, latency, sessions, turns, pauses and failures."""

from __future__ import annotations

from deploy.grafana.dashboards.panels import Panel, quantiles, rate, sel

GC_PAUSES = "clawrl_gateway_gc_pause_seconds_total"
SERVER_ERRORS = '{status=~"5.."}'

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
