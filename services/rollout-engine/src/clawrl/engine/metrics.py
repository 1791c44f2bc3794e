"""The engine's Prometheus metrics, on a registry built at start (no process-wide registry).

The serving metrics carry SGLang's names and its `model_name` label, so dashboards and alerts
written for SGLang pods read the CPU engine unchanged. Failures the CPU engine adds are named
`clawrl_engine_*`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from clawrl.common.metrics import LATENCY_BUCKETS_S

# Inter-token latencies on CPU: from a few ms (tiny model) to seconds (long batched prefill).
ITL_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 64, 128)


class EngineMetrics:
    """Every metric the engine exports, already bound to its model_name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._sglang(self.registry, model_name)
        self._scheduling(self.registry)
        self._lora(self.registry)

    def _sglang(self, r: CollectorRegistry, model_name: str) -> None:
        """SGLang's metrics, under its names and bound to its model_name label."""
        labels = ["model_name"]

        def bound(metric):
            return metric.labels(model_name=model_name)

        self.num_running_reqs = bound(
            Gauge("sglang:num_running_reqs", "Running requests.", labels, registry=r)
        )
        self.num_queue_reqs = bound(
            Gauge("sglang:num_queue_reqs", "Requests waiting for a batch slot.", labels, registry=r)
        )
        self.num_used_tokens = bound(
            Gauge("sglang:num_used_tokens", "Tokens held in the KV cache.", labels, registry=r)
        )
        self.token_usage = bound(
            Gauge("sglang:token_usage", "KV-cache usage (0..1).", labels, registry=r)
        )
        self.gen_throughput = bound(
            Gauge("sglang:gen_throughput", "Generation throughput (token/s).", labels, registry=r)
        )
        self.cache_hit_rate = bound(
            Gauge(
                "sglang:cache_hit_rate", "Prefix-cache hit rate (no cache: 0).", labels, registry=r
            )
        )
        self.prompt_tokens = bound(
            Counter("sglang:prompt_tokens", "Prefilled prompt tokens.", labels, registry=r)
        )
        self.generation_tokens = bound(
            Counter("sglang:generation_tokens", "Generated tokens.", labels, registry=r)
        )
        self.num_requests = bound(
            Counter("sglang:num_requests", "Finished requests.", labels, registry=r)
        )
        self.time_to_first_token = bound(
            Histogram(
                "sglang:time_to_first_token_seconds",
                "Time to first token.",
                labels,
                buckets=LATENCY_BUCKETS_S,
                registry=r,
            )
        )
        self.e2e_request_latency = bound(
            Histogram(
                "sglang:e2e_request_latency_seconds",
                "End-to-end request latency.",
                labels,
                buckets=LATENCY_BUCKETS_S,
                registry=r,
            )
        )
        self.inter_token_latency = bound(
            Histogram(
                "sglang:inter_token_latency_seconds",
                "Time between consecutive tokens of one request.",
                labels,
                buckets=ITL_BUCKETS_S,
                registry=r,
            )
        )

    def _scheduling(self, r: CollectorRegistry) -> None:
        """The CPU engine's scheduler: refusals, aborts, batches, the prefix cache, weight loads."""
        self.rejected_requests = Counter(
            "clawrl_engine_rejected_requests",
            "Requests refused before generation, by reason (invalid, adapter_not_loaded, "
            "queue_full, paused).",
            ["reason"],
            registry=r,
        )
        self.aborted_requests = Counter(
            "clawrl_engine_aborted_requests",
            "Requests ended early, by reason (client_gone, pause, error).",
            ["reason"],
            registry=r,
        )
        self.weight_updates = Counter(
            "clawrl_engine_weight_updates",
            "Weight updates from disk, by result (success, failure).",
            ["result"],
            registry=r,
        )
        self.decode_batch_size = Histogram(
            "clawrl_engine_decode_batch_size",
            "Sequences decoded together in one forward pass.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.max_decode_batch_size = Gauge(
            "clawrl_engine_max_decode_batch_size",
            "Largest decode batch since start.",
            registry=r,
        )
        self.prefill_batch_size = Histogram(
            "clawrl_engine_prefill_batch_size",
            "Prompts prefilled together in one forward pass.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.retracted_requests = Counter(
            "clawrl_engine_retracted_requests",
            "Running requests whose KV was dropped to be prefilled again later, by reason "
            "(kv_budget, pause, weight_update).",
            ["reason"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "clawrl_engine_cached_prompt_tokens",
            "Prompt tokens taken from the prefix cache instead of being prefilled.",
            registry=r,
        )
        self.prefix_cache_tokens = Gauge(
            "clawrl_engine_prefix_cache_tokens",
            "Tokens whose KV the prefix cache holds.",
            registry=r,
        )
        self.prefill_chunk_tokens = Histogram(
            "clawrl_engine_prefill_chunk_tokens",
            "Tokens of one sequence prefilled in one forward pass.",
            buckets=(16, 64, 256, 512, 1024, 2048, 4096, 8192),
            registry=r,
        )
        self.engine_errors = Counter(
            "clawrl_engine_forward_errors",
            "Forward passes that raised (their requests are aborted).",
            registry=r,
        )

    def _lora(self, r: CollectorRegistry) -> None:
        """LoRA adapters: loads, swaps, slots and evictions."""
        self.lora_adapters = Gauge(
            "clawrl_engine_lora_adapters", "LoRA adapters loaded.", registry=r
        )
        self.lora_updates = Counter(
            "clawrl_engine_lora_updates",
            "LoRA adapter loads and unloads, by op (load, unload) and result (success, failure).",
            ["op", "result"],
            registry=r,
        )
        self.lora_load_seconds = Histogram(
            "clawrl_engine_lora_load_seconds",
            "Duration of a successful adapter load: reading and checking it (beside serving), "
            "then injecting it.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.lora_swap_seconds = Histogram(
            "clawrl_engine_lora_swap_seconds",
            "Time the model thread spent adding or deleting an adapter, by op (load: injected, "
            "unload, evict: made non-resident, replace: an evicted adapter's injected modules "
            "reused by one of the same shape): the pause it puts between two decode steps.",
            ["op"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.lora_resident = Gauge(
            "clawrl_engine_lora_adapters_resident",
            "LoRA adapters injected in the model, ready to batch (at most max_loras_per_batch).",
            registry=r,
        )
        self.lora_on_demand_loads = Counter(
            "clawrl_engine_lora_on_demand_loads",
            "Loaded but non-resident adapters injected because a request needed them.",
            registry=r,
        )
        self.lora_evictions = Counter(
            "clawrl_engine_lora_evictions",
            "Adapters evicted, by level: resident (made room for another in the model; kept "
            "in host memory) or loaded (unloaded by max_loaded_loras; reloaded from its path "
            "by a later request).",
            ["level"],
            registry=r,
        )
        self.lora_slot_waits = Counter(
            "clawrl_engine_lora_slot_waits",
            "Requests that waited for an adapter slot (the batch held max_loras_per_batch "
            "adapters, every resident one was busy, or their adapter was draining).",
            registry=r,
        )
        self.lora_slot_wait_seconds = Histogram(
            "clawrl_engine_lora_slot_wait_seconds",
            "How long a request that waited for an adapter slot waited, until admitted.",
            buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
            registry=r,
        )
        self.lora_drains = Counter(
            "clawrl_engine_lora_drains",
            "Adapters of a full batch drained (no new requests until theirs end) to make room "
            "for one that waited past lora_drain_wait_threshold.",
            registry=r,
        )
        self.lora_merge_failures = Counter(
            "clawrl_engine_lora_merge_failures",
            "Merged weights of an adapter (engine.lora_merge_after) that could not be built (no "
            "memory for the copy); merging is then off and such batches run stacked.",
            registry=r,
        )
