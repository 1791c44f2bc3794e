"""`clawrl-engine --backend sglang`: the same settings turned into SGLang's launcher command.

Flag names are SGLang's `ServerArgs` fields (python/sglang/srt/server_args.py, `tp_size` ->
`--tp-size`). `build_argv` is pure so it can be checked without SGLang installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from clawrl.common.models import (
    ModelNotFoundError,
    resolve_model_dir,
    rope_stretch,
    served_model_name,
    trained_context,
)
from clawrl.engine.settings import EngineServerSettings, EngineSettings

# [sglang] fields passed as `--flag value` when set (None: SGLang decides).
SCHEDULER_FLAGS = (
    "max_running_requests",
    "max_queued_requests",
    "max_total_tokens",
    "max_prefill_tokens",
    "chunked_prefill_size",
)


# SGLang's generic PyTorch path on a machine without GPUs (`make run --engine sglang`,
# bench_engines): SGLang's own CPU engine needs a CPU build of sgl-kernel, which PyPI lacks.
# --sleep-on-idle: an idle scheduler otherwise polls for work and keeps part of a core busy.
CPU_ARGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--grammar-backend", "none",
    "--skip-server-warmup",
    "--sleep-on-idle",
)  # fmt: skip


def sglang_venv(env: Mapping[str, str] = os.environ) -> Path:
    """Where `make setup-sglang` (scripts/setup-sglang.sh) puts SGLang's venv."""
    if env.get("CLAWRL_SGLANG_VENV"):
        return Path(env["CLAWRL_SGLANG_VENV"])
    cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "clawrl" / "sglang-venv"


def model_path(settings: EngineSettings) -> str:
    """A prepared/local model directory when there is one, else the name as given (SGLang
    resolves Hugging Face ids and mounted paths itself)."""
    try:
        return str(resolve_model_dir(settings.model))
    except ModelNotFoundError:
        return settings.model.path


def build_argv(settings: EngineSettings, model: str | None = None) -> list[str]:
    """`python -m sglang.launch_server ...` for these settings."""
    sg, serving = settings.sglang, settings.engine
    model = model or model_path(settings)
    argv = [
        sg.python, "-m", "sglang.launch_server",
        "--model-path", model,
        "--host", serving.host,
        "--port", str(serving.port),
        "--tp-size", str(sg.tp_size),
        "--dtype", sg.dtype,
        "--served-model-name", served_model_name(settings.model),
        "--weight-version", serving.weight_version,
        "--log-level", sg.log_level,
    ]  # fmt: skip
    if sg.dp_size > 1:
        argv += ["--dp-size", str(sg.dp_size)]
    context_length = sg.context_length or settings.model.context_length
    if context_length:
        argv += ["--context-length", str(context_length)]
        rope = rope_override(model, context_length, settings.model.rope_scaling)
        if rope is not None:
            argv += ["--json-model-override-args", json.dumps({"rope_scaling": rope})]
    if sg.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(sg.mem_fraction_static)]
    for name in SCHEDULER_FLAGS:
        value = getattr(sg, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    if sg.incremental_streaming_output:
        argv.append("--incremental-streaming-output")
    if sg.disable_radix_cache:
        argv.append("--disable-radix-cache")
    if settings.model.chat_template is not None:
        argv += ["--chat-template", str(Path(settings.model.chat_template))]
    if sg.tool_call_parser:
        argv += ["--tool-call-parser", sg.tool_call_parser]
    if sg.reasoning_parser:
        argv += ["--reasoning-parser", sg.reasoning_parser]
    if sg.random_seed is not None:
        argv += ["--random-seed", str(sg.random_seed)]
    argv += lora_flags(serving)
    if sg.enable_metrics:
        argv.append("--enable-metrics")
    if sg.trust_remote_code:
        argv.append("--trust-remote-code")
    return argv + list(sg.extra_args)


def lora_flags(serving: EngineServerSettings) -> list[str]:
    """SGLang's LoRA flags for the `[engine]` LoRA settings (none when LoRA is off)."""
    if not serving.lora_enabled:
        return []
    argv = ["--enable-lora", "--max-loras-per-batch", str(serving.max_loras_per_batch)]
    if serving.lora_paths:
        argv += ["--lora-paths", *serving.lora_paths]
    if serving.max_lora_rank is not None:
        argv += ["--max-lora-rank", str(serving.max_lora_rank)]
    if serving.lora_target_modules:
        argv += ["--lora-target-modules", *serving.lora_target_modules]
    if serving.max_loaded_loras is not None:
        argv += ["--max-loaded-loras", str(serving.max_loaded_loras)]
    argv += ["--lora-eviction-policy", serving.lora_eviction_policy]
    argv += ["--lora-drain-wait-threshold", str(serving.lora_drain_wait_threshold)]
    return argv


def rope_override(model: str, context_length: int, rope_type: str) -> dict | None:
    """RoPE scaling for a context beyond what a local model was trained on (the same stretch
    the CPU engine and the trainer apply), or None (a hub id, or a context the model has)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    return rope_stretch(trained_context(json.loads(config.read_text())), context_length, rope_type)


def build_env(settings: EngineSettings, base: Mapping[str, str]) -> dict[str, str]:
    """SGLang's environment: `base` plus the variables the settings imply."""
    env = dict(base)
    if settings.sglang.context_length or settings.model.context_length:
        # SGLang refuses a context beyond the model's config unless told it is deliberate.
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    if settings.sglang.return_original_logprob:
        # Same log-prob semantics on GPUs as on the CPU engine, so recorded turns mean one thing.
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    return env


def exec_sglang(settings: EngineSettings) -> None:
    """Replace this process with SGLang's server (signals then reach SGLang directly)."""
    argv = build_argv(settings)
    os.execvpe(argv[0], argv, build_env(settings, os.environ))
