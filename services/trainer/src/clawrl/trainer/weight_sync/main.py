"""`clawrl-weight-sync`: `run` does one sync (the local process or the Kubernetes Job);
`watch` is the launcher that runs one sync per new policy version (newest wins).

Flags override env (`CLAWRL_GATEWAYS__ADDRESSES`, ...) and clawrl.toml. `run` exits 0 when the
engines serve the version (or already did), 1 when the sync failed and the gateways were resumed
on the old version, 2 when another sync holds the lock, 3 when engines could not be rolled back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import signal
import sys
import time

from prometheus_client import start_http_server

from clawrl.common import redis_client
from clawrl.common.logs import configure_logging
from clawrl.common.versions import VersionReady, latest
from clawrl.trainer.weight_sync.job import sync_version
from clawrl.trainer.weight_sync.kube import KubernetesLauncher, load_template
from clawrl.trainer.weight_sync.launcher import LocalLauncher, SyncWatcher
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

log = logging.getLogger(__name__)


def csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="clawrl-weight-sync", description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", help="Redis URL (redis.url)")
    parser.add_argument(
        "--gateways", type=csv, help="GatewayControl host:port list, comma-separated"
    )
    parser.add_argument("--engines", type=csv, help="policy engine URLs, comma-separated")
    parser.add_argument("--lease-s", type=float, help="pause lease (gateways.lease_s)")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="one sync: pause, load version N, resume")
    run.add_argument(
        "--version", type=int, help="policy version to load (default: the newest announced)"
    )
    run.add_argument("--path", help="checkpoint directory as the engines see it (with --version)")
    run.add_argument(
        "--adapter",
        default="",
        help="with --version: the path is this LoRA adapter's directory (policy-vN); the sync "
        "loads it beside the served one and switches the gateways, with no pause",
    )
    run.add_argument(
        "--tenant",
        default="",
        help="with --adapter: the tenant whose adapter it is (tenant-T-vN; default: the tenant "
        "the adapter's name gives); only that tenant's requests switch",
    )
    run.add_argument("--job-id", help="this job's name (lock token and pause holder)")
    watch = commands.add_parser("watch", help="one sync per announced version, newest first")
    watch.add_argument("--mode", choices=["local", "kubernetes"], help="launcher.mode")
    watch.add_argument(
        "--metrics-port", type=int, help="serve /metrics here (launcher.metrics_port)"
    )
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> WeightSyncSettings:
    return WeightSyncSettings().with_overrides(
        {
            "redis": {"url": args.redis_url},
            "gateways": {"addresses": args.gateways, "lease_s": args.lease_s},
            "engines": {"urls": args.engines},
            "launcher": {
                "mode": getattr(args, "mode", None),
                "metrics_port": getattr(args, "metrics_port", None),
            },
        }
    )


async def run_once(settings: WeightSyncSettings, args: argparse.Namespace) -> int:
    redis = redis_client.connect(settings.redis, socket_timeout=settings.redis.socket_timeout_s)
    if args.version is None:  # a manual run (the chart's suspended CronJob): the newest version
        ready = await latest(redis, settings.redis.versions_stream)
        if ready is None:
            log.error("no version announced on %s: nothing to sync", settings.redis.versions_stream)
            await redis.aclose()
            return 1
    else:
        ready = VersionReady(
            version=args.version,
            path=args.path,
            step=0,
            created_at=time.time(),
            adapter=args.adapter,
            tenant=args.tenant,
        )
    job_id = args.job_id or f"sync-v{ready.version}-{secrets.token_hex(3)}"
    task = asyncio.create_task(sync_version(settings, redis, ready, job_id))
    # SIGTERM (Job deletion, Ctrl-C of the stack) cancels the sync, which resumes the gateways.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        result = await task
    except asyncio.CancelledError:
        return 1
    finally:
        await redis.aclose()
    return result.exit_code


async def watch(settings: WeightSyncSettings) -> None:
    metrics = WeightSyncMetrics()
    if settings.launcher.metrics_port is not None:
        start_http_server(settings.launcher.metrics_port, registry=metrics.registry)
    if settings.launcher.mode == "kubernetes":
        launch = KubernetesLauncher(
            load_template(settings.launcher.job_template),
            settings.launcher.namespace,
            settings.launcher.job_timeout_s,
        )
    else:
        launch = LocalLauncher(settings)
    redis = redis_client.connect(settings.redis, socket_timeout=None)
    log.info("watching %s for new policy versions (%s syncs)", settings.redis.versions_stream,
             settings.launcher.mode)  # fmt: skip
    task = asyncio.create_task(SyncWatcher(settings, redis, launch, metrics).run_forever())
    # SIGTERM/SIGINT cancel the watcher, which stops a running sync job (it resumes the gateways).
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log.info("stopped")
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "run" and (args.version is None) != (args.path is None):
        sys.exit("clawrl-weight-sync run: give --version and --path together, or neither")
    if args.command == "run" and args.adapter and args.version is None:
        sys.exit("clawrl-weight-sync run: --adapter goes with --version and --path")
    if args.command == "run" and args.tenant and not args.adapter:
        sys.exit("clawrl-weight-sync run: --tenant goes with --adapter tenant-T-vN")
    settings = settings_from(args)
    configure_logging(settings.logging, "weight-sync")
    if args.command == "run":
        sys.exit(asyncio.run(run_once(settings, args)))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(watch(settings))


if __name__ == "__main__":
    main()
