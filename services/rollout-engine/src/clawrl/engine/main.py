"""`clawrl-engine`: serve a model with SGLang's HTTP API, on CPU (clawrl's engine) or on GPUs
(exec SGLang's own launcher with the same settings)."""

from __future__ import annotations

import argparse
import logging

from clawrl.common.logs import configure_logging
from clawrl.engine.settings import EngineSettings

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="clawrl rollout engine (SGLang HTTP API)")
    parser.add_argument("--host", help="bind address (engine.host)")
    parser.add_argument("--port", type=int, help="port (engine.port)")
    parser.add_argument("--model", help="model directory or prepared model name (model.path)")
    parser.add_argument("--backend", choices=["cpu", "sglang"], help="engine.backend")
    parser.add_argument("--weight-version", help="initial weight version (engine.weight_version)")
    parser.add_argument(
        "--max-running-requests", type=int, help="batch size cap (engine.max_running_requests)"
    )
    parser.add_argument(
        "--max-queued-requests", type=int, help="waiting-queue cap (engine.max_queued_requests)"
    )
    return parser.parse_args(argv)


def load_settings(args: argparse.Namespace) -> EngineSettings:
    """Settings from env/TOML, with the CLI flags given on top."""
    return EngineSettings().with_overrides(
        {
            "engine": {
                "host": args.host,
                "port": args.port,
                "backend": args.backend,
                "weight_version": args.weight_version,
                "max_running_requests": args.max_running_requests,
                "max_queued_requests": args.max_queued_requests,
            },
            "model": {"path": args.model},
        }
    )


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
