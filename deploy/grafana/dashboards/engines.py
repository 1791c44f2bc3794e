"""The engines dashboard: what SGLang's own metrics say of each policy and judge engine."""

from __future__ import annotations

from deploy.grafana.dashboards.panels import Panel, quantiles, rate, sel

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
