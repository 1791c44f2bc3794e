"""`clawrl-engine`: serve a model with SGLang's HTTP API, on CPU (clawrl's engine) or on GPUs
(exec SGLang's own launcher with the same settings)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from clawrl.common.logs import configure_logging
from clawrl.engine.settings import EngineSettings

log = logging.getLogger(__name__)

Target = tuple[str, str]  # (settings section, field)


@dataclass(frozen=True)
class Flag:
    """A command-line flag and, per backend, the setting it sets (None: not used there)."""

    name: str
    help: str
    cpu: Target | None
    sglang: Target | None
    type: type = str
    switch: bool = False
    many: bool = False  # one or more values (a list setting)


def everywhere(section: str, field: str) -> dict[str, Target]:
    """A setting both backends read from the same place."""
    return {"cpu": (section, field), "sglang": (section, field)}


def scheduler(field: str) -> dict[str, Target]:
    """A scheduler knob: `[engine]` for the CPU engine, `[sglang]` for SGLang's launcher."""
    return {"cpu": ("engine", field), "sglang": ("sglang", field)}


FLAGS = (
    Flag("--host", "bind address", **everywhere("engine", "host")),
    Flag("--port", "port", **everywhere("engine", "port"), type=int),
    Flag("--model", "model directory or prepared model name", **everywhere("model", "path")),
    Flag("--weight-version", "initial weight version", **everywhere("engine", "weight_version")),
    Flag("--context-length", "context window (beyond the model's: RoPE scaling)",
         **everywhere("model", "context_length"), type=int),
    Flag("--max-running-requests", "batch size cap", **scheduler("max_running_requests"), type=int),
    Flag("--max-queued-requests", "queue cap", **scheduler("max_queued_requests"), type=int),
    Flag("--max-total-tokens", "KV budget", **scheduler("max_total_tokens"), type=int),
    Flag("--max-prefill-tokens", "prefill token budget per round",
         **scheduler("max_prefill_tokens"), type=int),
    Flag("--chunked-prefill-size", "most prompt tokens per prefill forward pass",
         **scheduler("chunked_prefill_size"), type=int),
    Flag("--solo-prefill-size", "most prompt tokens per prefill pass while nothing decodes",
         cpu=("engine", "solo_prefill_size"), sglang=None, type=int),
    Flag("--random-seed", "sampler seed", **scheduler("random_seed"), type=int),
    Flag("--incremental-streaming-output", "stream events carry only what is new",
         **scheduler("incremental_streaming_output"), switch=True),
    Flag("--disable-radix-cache", "keep no prefix cache",
         **scheduler("disable_radix_cache"), switch=True),
    Flag("--prefix-cache-tokens", "prefix-cache budget in tokens",
         cpu=("engine", "prefix_cache_tokens"), sglang=None, type=int),
    Flag("--rope-scaling", "yarn or linear, for a context beyond the model's",
         **everywhere("model", "rope_scaling")),
    Flag("--dtype", "weights, activations and KV dtype (CPU: auto, float32 or bfloat16)",
         cpu=("engine", "dtype"), sglang=("sglang", "dtype")),
    Flag("--torch-threads", "torch intra-op threads", cpu=("engine", "torch_threads"),
         sglang=None, type=int),
    Flag("--tp-size", "tensor-parallel size", cpu=None, sglang=("sglang", "tp_size"), type=int),
    Flag("--enable-lora", "serve LoRA adapters", **everywhere("engine", "enable_lora"),
         switch=True),
    Flag("--lora-paths", "adapters to load at start: PATH, NAME=PATH or JSON",
         **everywhere("engine", "lora_paths"), many=True),
    Flag("--max-loras-per-batch", "most distinct adapters in one batch (base included)",
         **everywhere("engine", "max_loras_per_batch"), type=int),
    Flag("--max-lora-rank", "largest adapter rank accepted",
         **everywhere("engine", "max_lora_rank"), type=int),
    Flag("--lora-target-modules", "projections adapters may target (or all)",
         **everywhere("engine", "lora_target_modules"), many=True),
    Flag("--max-loaded-loras", "most adapters loaded at once (the LRU one is unloaded)",
         **everywhere("engine", "max_loaded_loras"), type=int),
    Flag("--lora-eviction-policy", "lru or fifo: which resident adapter makes room",
         **everywhere("engine", "lora_eviction_policy")),
    Flag("--lora-merge-after", "passes under one adapter alone before it is merged (0: never)",
         cpu=("engine", "lora_merge_after"), sglang=None, type=int),
    Flag("--lora-drain-wait-threshold", "seconds an adapter waits before a slot is drained",
         **everywhere("engine", "lora_drain_wait_threshold"), type=float),
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="clawrl rollout engine (SGLang HTTP API)")
    parser.add_argument("--backend", choices=["cpu", "sglang"], help="engine.backend")
    for flag in FLAGS:
        where = ", ".join(
            f"{backend}: {target[0]}.{target[1]}"
            for backend, target in (("cpu", flag.cpu), ("sglang", flag.sglang))
            if target is not None
        )
        if flag.switch:
            parser.add_argument(
                flag.name, action="store_true", default=None, help=f"{flag.help} ({where})"
            )
        else:
            nargs = "+" if flag.many else None
            parser.add_argument(
                flag.name, type=flag.type, nargs=nargs, help=f"{flag.help} ({where})"
            )
    return parser.parse_args(argv)


def load_settings(args: argparse.Namespace) -> EngineSettings:
    """Settings from env/TOML, with the CLI flags given on top, each routed to the section the
    chosen backend reads it from. A flag the backend has no use for is an error, not ignored."""
    base = EngineSettings()
    backend = args.backend or base.engine.backend
    overrides: dict[str, dict] = {"engine": {"backend": args.backend}}
    for flag in FLAGS:
        value = getattr(args, flag.name[2:].replace("-", "_"))
        if value is None:
            continue
        target = flag.cpu if backend == "cpu" else flag.sglang
        if target is None:
            raise SystemExit(f"clawrl-engine: {flag.name} has no effect with --backend {backend}")
        overrides.setdefault(target[0], {})[target[1]] = value
    return base.with_overrides(overrides)


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(parse_args(argv))
    configure_logging(settings.logging, "engine")
    if settings.engine.backend == "sglang":
        from clawrl.engine.launcher import exec_sglang

        exec_sglang(settings)
        return

    import uvicorn

    from clawrl.engine.server import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.engine.host,
        port=settings.engine.port,
        log_config=None,  # keep clawrl's structured logging
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
