"""`clawrl-trainer`: read the settings (flags override env and clawrl.toml), configure logging,
run the trainer until SIGTERM/SIGINT (the step in progress commits first).
`clawrl-trainer tenants [flags]` lists the tenants of the newest durable state with their steps
and adapter versions (`[tenants] mode = "per_tenant"`), and exits; `tenants reset T` asks the
trainer to drop T's adapter and free its slot (T is served the shared policy, and starts a new
adapter from it), `tenants remove T` the same, T then getting no adapter until a reset (both
applied before its next step, or at its next start); `tenants export T --out DIR` copies T's
newest version to DIR (a PEFT adapter).

Locally it starts its own Ray runtime; as a KubeRay RayJob entrypoint it joins the cluster
(`--ray-address auto`, or ray.address in the settings).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from clawrl.common.logs import configure_logging
from clawrl.trainer.driver import connect
from clawrl.trainer.service import BackgroundTask, serve
from clawrl.trainer.settings import TrainerSettings
from clawrl.trainer.tenants import TenantCommandError, export_tenant, print_tenants, request_reset

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None, *, tenants: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="clawrl-trainer tenants" if tenants else "clawrl-trainer",
        description="Consumes scored samples and takes PPO-style steps; exports HF checkpoints.",
    )
    if tenants:
        parser.add_argument(
            "action", nargs="?", default="list", choices=("list", "reset", "remove", "export"),
            help="list the tenants (default); reset one (a new adapter from the shared policy); "
            "remove one (no adapter until a reset); export one's newest version",
        )  # fmt: skip
        parser.add_argument("tenant", nargs="?", help="the tenant id (reset, remove, export)")
        parser.add_argument("--out", type=Path, help="export: a new directory to write")
    parser.add_argument("--model", help="base model path or prepared name (model.path)")
    parser.add_argument("--redis-url", help="Redis URL (redis.url)")
    parser.add_argument("--checkpoint-dir", help="checkpoint root (checkpoint.dir)")
    parser.add_argument("--batch-size", type=int, help="rollout.rollout_batch_size")
    parser.add_argument("--sync-interval", type=int, help="checkpoint.sync_interval")
    parser.add_argument("--metrics-port", type=int, help="server.metrics_port")
    parser.add_argument("--ray-address", help="ray.address ('auto' inside a Ray cluster)")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> TrainerSettings:
    """Settings with the given flags on top of env / TOML / defaults."""
    return TrainerSettings().with_overrides(
        {
            "model": {"path": args.model},
            "redis": {"url": args.redis_url},
            "checkpoint": {"dir": args.checkpoint_dir, "sync_interval": args.sync_interval},
            "rollout": {"rollout_batch_size": args.batch_size},
            "server": {"metrics_port": args.metrics_port},
            "ray": {"address": args.ray_address},
        }
    )


def tenants_command(args: argparse.Namespace) -> int:
    """`clawrl-trainer tenants [list|reset T|remove T|export T --out DIR]`; the exit code."""
    settings = settings_from(args)
    if args.action == "list":
        print_tenants(settings)
        return 0
    if not args.tenant or (args.action == "export") != (args.out is not None):
        print(f"clawrl-trainer tenants {args.action}: give the tenant id"
              + (" and --out DIR" if args.action == "export" else " (and no --out)"),
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        if args.action in ("reset", "remove"):
            entry = request_reset(settings, args.tenant, args.action)
            print(
                f"{args.action} of tenant {args.tenant} requested ({entry}); the trainer applies "
                "it before its next step: its adapter slot is freed and it is served the shared "
                "policy"
            )
        else:
            version, source = export_tenant(settings, args.tenant, args.out)
            print(f"exported tenant {args.tenant}'s version {version} ({source}) to {args.out}")
    except TenantCommandError as exc:
        print(f"clawrl-trainer tenants {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def background_tasks(settings: TrainerSettings) -> list[BackgroundTask]:
    """Tasks run next to the training loop; each feature adds its one line here."""
    return []


async def run(settings: TrainerSettings) -> None:
    stop = asyncio.Event()
    # Ray's driver installs its own SIGTERM handler: join or start Ray first, then ours.
    connect(settings.ray)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop, background_tasks(settings))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tenants"]:
        code = tenants_command(parse_args(argv[1:], tenants=True))
        if code:
            sys.exit(code)
        return
    settings = settings_from(parse_args(argv))
    configure_logging(settings.logging, "trainer")
    asyncio.run(run(settings))


if __name__ == "__main__":
    main()
