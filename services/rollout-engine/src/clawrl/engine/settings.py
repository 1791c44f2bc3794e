"""The rollout engine's settings: which model, how the CPU engine serves it, and how the SGLang
launcher turns the same settings into `sglang.launch_server` flags on GPU pods."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from clawrl.common.settings import ClawrlSettings, ModelSettings, Section

# Projections an adapter may target (SGLang's SUPPORTED_LORA_TARGET_MODULES for dense models).
LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
# The CPU engine's prompt tokens a prefill pass while nothing decodes, in bfloat16 (where larger
# passes pay: its matrix products cost twice as much per token at 256 rows as at 4096).
SOLO_PREFILL_BF16 = 4096


class EngineServerSettings(Section):
    """The engine's HTTP server and the CPU engine's scheduler (section `[engine]`). With
    backend `sglang` only host, port, backend, weight_version and the LoRA settings are used;
    SGLang's own scheduler is configured in `[sglang]`."""

    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(30010, gt=0, lt=65536, description="Port the HTTP server listens on.")
    backend: Literal["cpu", "sglang"] = Field(
        "cpu",
        description="`cpu`: clawrl's PyTorch engine in this process; `sglang`: exec SGLang's "
        "launcher with the `[sglang]` settings (GPU pods).",
    )
    weight_version: str = Field(
        "default",
        description="Version reported in meta_info and /get_model_info until the first "
        "/update_weights_from_disk names another (SGLang's default is `default`).",
    )
    max_running_requests: int = Field(
        16, gt=0, description="Most sequences decoded together in one batch."
    )
    max_queued_requests: int = Field(
        256, ge=0, description="Most requests waiting for a batch slot; beyond it, 503."
    )
    max_prefill_tokens: int = Field(
        8192,
        gt=0,
        description="Most prompt tokens admitted into prefill in one scheduling round.",
    )
    chunked_prefill_size: int = Field(
        256,
        gt=0,
        description="Most prompt tokens prefilled in one forward pass; a longer prompt is "
        "prefilled in chunks with a decode step of the running batch after each, so it does "
        "not stall other streams. SGLang uses 2048-8192 on GPUs, where such a chunk takes "
        "~0.1 s; on 2 CPU cores SmolLM2-135M prefills a few hundred tokens/s, so 256 keeps "
        "the pause between two tokens of a running stream near a second.",
    )
    solo_prefill_size: int | None = Field(
        None,
        ge=0,
        description="CPU engine: most prompt tokens prefilled in one forward pass while no "
        "other sequence is decoding (nothing to keep responsive); chunked_prefill_size applies "
        "as soon as one is. Fewer, larger passes read the weights fewer times: bfloat16 "
        "prefill gained 10-20 % from 4096-token passes, float32 nothing (and the allocator "
        f"kept ~400 MB more after one). None: {SOLO_PREFILL_BF16} in bfloat16, off in float32; "
        "0, or anything not above chunked_prefill_size: always chunked_prefill_size.",
    )
    max_total_tokens: int = Field(
        65536,
        gt=0,
        description="KV-cache budget in tokens held by running requests. A request is admitted "
        "while the tokens in use plus its prompt fit; when decoding outgrows the budget the "
        "newest request is retracted and re-prefilled later (as SGLang does). Also the "
        "denominator of sglang:token_usage.",
    )
    incremental_streaming_output: bool = Field(
        False,
        description="Stream events carry only what is new since the previous event (text, "
        "output_ids, log-probs) instead of everything so far (SGLang's "
        "--incremental-streaming-output). Cumulative events cost O(n^2) for long outputs.",
    )
    disable_radix_cache: bool = Field(
        False,
        description="Keep no prefix cache: every request prefills its whole prompt (SGLang's "
        "--disable-radix-cache).",
    )
    prefix_cache_tokens: int = Field(
        32768,
        gt=0,
        description="Most tokens the prefix cache keeps (least recently used evicted first). "
        "SmolLM2-135M holds ~46 KB of float32 KV per token (half in bfloat16): 32768 tokens ~ "
        "1.5 GB.",
    )
    default_max_new_tokens: int = Field(
        128,
        gt=0,
        description="max_new_tokens of a /generate request that gives none (SGLang: 128).",
    )
    torch_threads: int | None = Field(
        None, gt=0, description="torch intra-op threads; defaults to the CPU count."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32",
        description="Weights, activations and KV dtype of the CPU engine. float32: log-probs "
        "equal the trainer's float32 recomputation (within 1e-4). bfloat16: 1.5-3x faster on a "
        "CPU with native bf16 (avx512_bf16, amx_bf16), log-probs within the tolerance "
        "docs/engine.md states. auto: bfloat16 on such a CPU, else float32. Log-probs are "
        "computed in float32 from the logits either way.",
    )
    random_seed: int = Field(0, description="Seed of the sampler for requests that give none.")
    weight_group_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for a weight update group to form (/init_weights_update_group) "
        "or for one broadcast tensor.",
    )
    health_generate_timeout_s: float = Field(
        30.0, gt=0, description="Time /health_generate waits for its 1-token generation."
    )
    # LoRA serving, with SGLang's names and rules (both backends read these).
    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters beside the base model (SGLang's --enable-lora; implied "
        "by lora_paths). Off: no adapter code runs at all.",
    )
    lora_paths: list[str] = Field(
        default_factory=list,
        description="Adapters loaded at start, each `PATH`, `NAME=PATH` or JSON "
        '`{"lora_name": ..., "lora_path": ..., "pinned": ...}` (SGLang\'s --lora-paths).',
    )
    max_loras_per_batch: int = Field(
        8,
        gt=0,
        description="Most distinct adapters (the base model counting as one) in one running "
        "batch, and most adapters the CPU engine keeps injected (resident) at once; a request "
        "that would exceed it waits (SGLang's --max-loras-per-batch).",
    )
    max_loaded_loras: int | None = Field(
        None,
        gt=0,
        description="Most adapters loaded (registered, held in host memory) at once; loading "
        "one more unloads the least recently used unpinned one, which a later request naming "
        "it loads again from its path. None: no limit (SGLang's --max-loaded-loras).",
    )
    lora_eviction_policy: Literal["lru", "fifo"] = Field(
        "lru",
        description="Which resident adapter a request for a non-resident one evicts: the least "
        "recently used (lru) or the first injected (fifo); never one the running batch uses "
        "nor a pinned one (SGLang's --lora-eviction-policy).",
    )
    lora_drain_wait_threshold: float = Field(
        2.0,
        ge=0,
        description="Seconds a request may wait for an adapter slot before one adapter of the "
        "full running batch is drained (admits no new requests until its running ones end) to "
        "make room; 0: never drain (SGLang's --lora-drain-wait-threshold, whose default is 0).",
    )
    lora_merge_after: int = Field(
        8,
        ge=0,
        description="CPU engine: after this many forward passes in a row whose every row uses "
        "the same adapter, that adapter's weights are merged (W + s B A, summed in float32, "
        "stored in the model's dtype) and such passes run on them at the bare model's cost; "
        "mixed batches keep the stacked adapters. One adapter is merged at a time; its copy of "
        "the adapted projections costs their size (SmolLM2-135M, all seven projections: "
        "212 MB in bfloat16, 425 MB in float32). Dropped on a weight update and when the "
        "merged adapter is unloaded or replaced. 0: never merge.",
    )
    max_lora_rank: int | None = Field(
        None,
        gt=0,
        description="Largest adapter rank accepted; None: the largest rank of lora_paths "
        "(SGLang's --max-lora-rank).",
    )
    lora_target_modules: list[str] | None = Field(
        None,
        description="Projections adapters may target (q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj, qkv_proj, gate_up_proj, or `all`); None: those of "
        "lora_paths (SGLang's --lora-target-modules).",
    )

    @property
    def lora_enabled(self) -> bool:
        """LoRA serving is on: asked for, or implied by adapters to load at start."""
        return self.enable_lora or bool(self.lora_paths)

    @model_validator(mode="after")
    def _check_lora(self) -> EngineServerSettings:
        modules = self.lora_target_modules
        if modules is not None:
            unknown = sorted(set(modules) - set(LORA_TARGET_MODULES) - {"all"})
            if unknown:
                raise ValueError(
                    f"lora_target_modules {unknown} are not supported; choose from "
                    f"{', '.join(LORA_TARGET_MODULES)} or all"
                )
            if "all" in modules and len(modules) > 1:
                raise ValueError(
                    "If 'all' is specified in --lora-target-modules, it should be the only "
                    "module specified."
                )
        if self.max_loaded_loras is not None:
            if self.max_loaded_loras < self.max_loras_per_batch:
                raise ValueError(
                    "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                    f"max_loaded_loras={self.max_loaded_loras}, "
                    f"max_loras_per_batch={self.max_loras_per_batch}"
                )
            if len(self.lora_paths) > self.max_loaded_loras:
                raise ValueError(
                    "The number of LoRA paths should not exceed max_loaded_loras. "
                    f"max_loaded_loras={self.max_loaded_loras}, lora_paths={len(self.lora_paths)}"
                )
        if self.lora_enabled and not self.lora_paths:
            if self.max_lora_rank is None or not modules:
                raise ValueError(
                    "When no initial --lora-paths is provided, you need to specify both "
                    "--max-lora-rank and --lora-target-modules for LoRA initialization."
                )
        return self


class SGLangSettings(Section):
    """Flags for `python -m sglang.launch_server` (section `[sglang]`; backend `sglang` only)."""

    python: str = Field("python3", description="Interpreter that runs sglang.launch_server.")
    tp_size: int = Field(1, gt=0, description="Tensor-parallel size (GPUs per engine).")
    dp_size: int = Field(1, gt=0, description="Data-parallel replicas inside one engine.")
    mem_fraction_static: float | None = Field(
        None, gt=0, le=1, description="GPU memory fraction for weights + KV cache (None: SGLang's)."
    )
    context_length: int | None = Field(
        None, gt=0, description="Context length override (None: model.context_length or config)."
    )
    max_running_requests: int | None = Field(
        None, gt=0, description="SGLang's cap on concurrently running requests (None: SGLang's)."
    )
    max_queued_requests: int | None = Field(
        None, gt=0, description="SGLang's cap on waiting requests (None: SGLang's, unbounded)."
    )
    max_total_tokens: int | None = Field(
        None, gt=0, description="SGLang's KV-pool size in tokens (None: sized from GPU memory)."
    )
    max_prefill_tokens: int | None = Field(
        None, gt=0, description="SGLang's prefill token budget per batch (None: SGLang's)."
    )
    chunked_prefill_size: int | None = Field(
        None, description="SGLang's prefill chunk size; -1 disables chunking (None: SGLang's)."
    )
    incremental_streaming_output: bool = Field(
        False, description="SGLang's --incremental-streaming-output (events carry only news)."
    )
    disable_radix_cache: bool = Field(False, description="SGLang's --disable-radix-cache.")
    dtype: str = Field("auto", description="Weights dtype (`auto`, `bfloat16`, `float16`, ...).")
    enable_metrics: bool = Field(True, description="Expose Prometheus metrics at /metrics.")
    tool_call_parser: str | None = Field(
        None, description="SGLang tool-call parser (`qwen25`, `llama3`, `hermes`, ...)."
    )
    reasoning_parser: str | None = Field(
        None, description="SGLang reasoning parser (`qwen3`, `deepseek-r1`, ...)."
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code from the repo.")
    random_seed: int | None = Field(None, description="SGLang's --random-seed.")
    log_level: str = Field("info", description="SGLang's --log-level.")
    return_original_logprob: bool = Field(
        True,
        description="Report log-probs of the raw distribution (before temperature), as the CPU "
        "engine does, by setting SGLANG_RETURN_ORIGINAL_LOGPROB=1; SGLang's own default "
        "divides the logits by the temperature first.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More flags appended verbatim, e.g. ['--attention-backend', 'fa3'].",
    )


class EngineSettings(ClawrlSettings):
    """Everything `clawrl-engine` needs, built once at start and passed down."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineServerSettings = Field(default_factory=EngineServerSettings)
    sglang: SGLangSettings = Field(default_factory=SGLangSettings)
