"""The judge's two small servers: the `Judge` gRPC service (Score(Turn) -> Sample, with health
and reflection) and the HTTP endpoint for /metrics, /healthz and /readyz. Domain errors map to
gRPC status here, in one place."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
from aiohttp import web

from clawrl.common.grpc_serving import start_with_health
from clawrl.common.metrics import exposition
from clawrl.common.proto import judge_pb2, judge_pb2_grpc
from clawrl.common.sglang_client import EngineRequestError, EngineUnavailable
from clawrl.judge.core import Judge
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.rewards import RewardFnError
from clawrl.judge.turns import MalformedTurn, check_turn

log = logging.getLogger(__name__)

SERVICE = judge_pb2.DESCRIPTOR.services_by_name["Judge"].full_name


def grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of a failure to score a turn."""
    if isinstance(exc, MalformedTurn):
        return grpc.StatusCode.INVALID_ARGUMENT, f"cannot judge this turn: {exc}"
    if isinstance(exc, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, f"judge engine unavailable: {exc.message}"
    if isinstance(exc, EngineRequestError):
        return grpc.StatusCode.FAILED_PRECONDITION, f"judge engine rejected: {exc.message}"
    if isinstance(exc, RewardFnError):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class JudgeServicer(judge_pb2_grpc.JudgeServicer):
    def __init__(self, judge: Judge, metrics: JudgeMetrics) -> None:
        self.judge = judge
        self.metrics = metrics

    async def Score(self, request, context):
        try:
            judgement = await self.judge.judge(check_turn(request))
        except Exception as exc:
            code, message = grpc_status(exc)
            self.metrics.errors.labels("grpc").inc()
            log.warning("Score(%s) failed: %s", request.turn_id or "?", message)
            await context.abort(code, message)
        return judgement.sample


async def start_grpc(judge: Judge, metrics: JudgeMetrics, host: str, port: int):
    """Start Judge + health + reflection; returns (server, bound port)."""
    server = grpc.aio.server()
    judge_pb2_grpc.add_JudgeServicer_to_server(JudgeServicer(judge, metrics), server)
    bound = await start_with_health(server, SERVICE, host, port)
    return server, bound


async def start_http(
    metrics: JudgeMetrics, ready: Callable[[], Awaitable[dict]], host: str, port: int
) -> tuple[web.AppRunner, int]:
    """/metrics, /healthz (alive) and /readyz (Redis and engines answer); returns the runner
    (to clean up) and the bound port."""

    async def metrics_route(request: web.Request) -> web.Response:
        payload, content_type = exposition(metrics.registry)
        return web.Response(body=payload, headers={"Content-Type": content_type})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        checks = await ready()
        ok = all(checks.values())
        return web.json_response(
            {"status": "ready" if ok else "not ready", **checks}, status=200 if ok else 503
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
