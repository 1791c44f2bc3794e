"""`clawrl-gateway`: read the settings (flags override env and clawrl.toml), configure logging,
serve the app (HTTP API; GatewayControl gRPC starts in its lifespan)."""

from __future__ import annotations

import argparse
import importlib.util
import logging

import uvicorn

from clawrl.common.logs import configure_logging
from clawrl.gateway.app import create_app
from clawrl.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="clawrl-gateway",
        description="OpenAI-compatible gateway that records main turns for online training.",
    )
    parser.add_argument("--host", help="HTTP address (serving.host)")
    parser.add_argument("--port", type=int, help="HTTP port (serving.port, default 30000)")
    parser.add_argument("--engine-url", help="policy engine URL (serving.engine_url)")
    parser.add_argument("--redis-url", help="Redis URL (redis.url)")
    parser.add_argument("--model", help="policy model path or prepared name (model.path)")
    parser.add_argument("--grpc-port", type=int, help="GatewayControl port (control.port)")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    """Settings with the given flags on top of env / TOML / defaults."""
    return GatewaySettings().with_overrides(
        {
            "serving": {"host": args.host, "port": args.port, "engine_url": args.engine_url},
            "redis": {"url": args.redis_url},
            "model": {"path": args.model},
            "control": {"port": args.grpc_port},
        }
    )


def main(argv: list[str] | None = None) -> None:
    settings = settings_from(parse_args(argv))
    configure_logging(settings.logging, "gateway")
    # uvloop and httptools take a visible share off the gateway's per-request overhead.
    fast = importlib.util.find_spec("uvloop") is not None
    uvicorn.run(
        create_app(settings),
        host=settings.serving.host,
        port=settings.serving.port,
        loop="uvloop" if fast else "asyncio",
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
        log_config=None,
        access_log=False,
        timeout_keep_alive=75,
        proxy_headers=False,  # scope["client"] is never used; skip its rewrite per request
    )


if __name__ == "__main__":
    main()
