"""`clawrl-judge`: run the judge workers (flags override env and clawrl.toml), or
`clawrl-judge export` the audit trail as JSONL."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import IO

from clawrl.common.logs import configure_logging
from clawrl.judge.audit import export
from clawrl.judge.service import create_redis, running
from clawrl.judge.settings import JudgeSettings

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="clawrl-judge",
        description="Turns finished turns (clawrl:turns) into training samples (clawrl:samples).",
    )
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the judge workers (the default)")
    out = sub.add_parser("export", help="write the audit trail (every judgement) as JSONL")
    out.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    out.add_argument("--since", default="-", help="first audit entry id (default: all)")
    for p in (parser, run, out):
        p.add_argument("--redis-url", help="Redis URL (redis.url)")
    for p in (parser, run):
        p.add_argument("--mode", choices=("rl", "opd", "combine"), help="judging.mode")
        p.add_argument("--reward-fn", help="reward plug-in module:function (judging.reward_fn)")
        p.add_argument("--engine-url", help="judge engine, SGLang API (backend.engine_url)")
        p.add_argument("--model", help="policy model path or prepared name (model.path)")
        p.add_argument("--judge-model", help="judge engine's model, for votes (judge_model.path)")
        p.add_argument("--workers", type=int, help="consumers in this process (workers.workers)")
        p.add_argument("--consumer", help="consumer name (workers.consumer)")
        p.add_argument("--grpc-port", type=int, help="Judge gRPC port (judge_server.grpc_port)")
        p.add_argument("--metrics-port", type=int, help="/metrics port (judge_server.metrics_port)")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> JudgeSettings:
    """Settings with the given flags on top of env / TOML / defaults."""
    get = lambda name: getattr(args, name, None)  # noqa: E731
    overrides = {
        "redis": {"url": get("redis_url")},
        "judging": {"mode": get("mode"), "reward_fn": get("reward_fn")},
        "backend": {"engine_url": get("engine_url")},
        "model": {"path": get("model")},
        "workers": {"workers": get("workers"), "consumer": get("consumer")},
        "judge_server": {"grpc_port": get("grpc_port"), "metrics_port": get("metrics_port")},
    }
    settings = JudgeSettings()
    if get("judge_model"):  # the section is optional: start from the policy model's
        base = settings.judge_model or settings.model
        settings = settings.model_copy(update={"judge_model": base.model_copy()})
        overrides["judge_model"] = {"path": get("judge_model")}
    return settings.with_overrides(overrides)


async def serve(settings: JudgeSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running(settings) as service:
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(service.stop.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        log.info("stopping: draining in-flight turns")
        service.stop.set()
    if service.failed is not None:
        raise SystemExit(1)


async def run_export(settings: JudgeSettings, out: IO[bytes], since: str) -> int:
    redis = create_redis(settings)
    try:
        # Shard by shard when the store is sharded (each shard's trail in its own order).
        total = 0
        for stream in settings.redis.shards().names(settings.audit.stream):
            total += await export(redis, stream, out, since)
        return total
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_from(args)
    configure_logging(settings.logging, "judge")
    if args.command == "export":
        with contextlib.ExitStack() as files:
            out = (
                sys.stdout.buffer
                if args.output == "-"
                else files.enter_context(open(args.output, "wb"))
            )
            count = asyncio.run(run_export(settings, out, args.since))
        print(f"exported {count} judgements", file=sys.stderr)
        return
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
