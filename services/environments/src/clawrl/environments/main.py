"""`clawrl-environments`: read the settings (flags override env and clawrl.toml), configure
logging, serve the lease API. The start fails, with the reason, when the backend cannot isolate
a sandbox on this host."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from clawrl.common.logs import configure_logging
from clawrl.environments.api import create_app
from clawrl.environments.settings import EnvironmentsSettings

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="clawrl-environments",
        description="Sandboxes leased to agents over OpenClaw-RL's pool API (/allocate, "
        "/heartbeat, /reset, /exec_tool, /evaluate, /close).",
    )
    parser.add_argument("--host", help="HTTP address (environments_server.host)")
    parser.add_argument("--port", type=int, help="HTTP port (environments_server.port)")
    parser.add_argument("--backend", choices=("local", "kubernetes"), help="leases.backend")
    parser.add_argument("--max-leases", type=int, help="leases held at once (leases.max_leases)")
    parser.add_argument("--ttl", type=float, help="lease TTL in seconds (leases.ttl_s)")
    parser.add_argument(
        "--root-dir", type=Path, help="local sandboxes' directory (sandbox.root_dir)"
    )
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> EnvironmentsSettings:
    """Settings with the given flags on top of env / TOML / defaults."""
    return EnvironmentsSettings().with_overrides(
        {
            "environments_server": {"host": args.host, "port": args.port},
            "leases": {
                "backend": args.backend,
                "max_leases": args.max_leases,
                "ttl_s": args.ttl,
            },
            "sandbox": {"root_dir": args.root_dir},
        }
    )


def main(argv: list[str] | None = None) -> None:
    settings = settings_from(parse_args(argv))
    configure_logging(settings.logging, "environments")
    server = settings.environments_server
    uvicorn.run(
        create_app(settings),
        host=server.host,
        port=server.port,
        # The plain asyncio loop: sandboxes are subprocesses started with a uid switch and
        # extra file descriptors, which uvloop's subprocess support does not take.
        loop="asyncio",
        log_config=None,
        access_log=False,
    )


if __name__ == "__main__":
    main()
