"""The lease API over HTTP: a FastAPI app whose lifespan builds the backend (and refuses to start
when it cannot isolate), the lease pool and its reaper; each route parses, calls the pool, and
answers JSON. Errors map to HTTP in one place (`error_response`).

Endpoints, all POST with a JSON body unless noted. Fields marked * are OpenClaw-RL's
(`terminal-rl/remote/pool_server.py` and `env_client.py`); the others are this service's.

- /allocate: task_key*, request_id* -> lease_id*, reused*, task_key, expires_in_s
- /heartbeat: lease_id* -> expires_in_s
- /reset: lease_id*, task_meta*, run_ctx*, task_timeouts* (its eval*) -> user_msg*,
  tool_schemas*, tools, workspace
- /exec_tool: lease_id*, tool_call* {name*, arguments*} -> observation*, result {stdout,
  stderr, exit_code, timed_out, truncated, duration_s, limit} (null for an invalid call)
- /evaluate: lease_id*, checker, timeout_s -> score*, passed, exit_code, output, timed_out,
  duration_s
- /close: lease_id* -> found*
- GET /health, GET /healthz*: backend, active_leases, max_leases
- GET /status*: pool {max_leases, active_leases, leases [...]}
- GET /metrics: Prometheus text

An error answers `{"ok": false, "error": <message>, "code": <word>}`* with its status: 400
BAD_REQUEST / BAD_TASK, 401 UNAUTHORIZED, 404 LEASE_NOT_FOUND, 409 NOT_RESET, 413 TOO_LARGE,
429 POOL_EXHAUSTED (with Retry-After; OpenClaw-RL's server also answers 429 when full), 503
SANDBOX_ERROR, 500 INTERNAL. /evaluate's score is 1.0 or 0.0 (theirs is the share of unit tests
passed); /evaluate runs a checker script given in the request or at /reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from clawrl.common.metrics import exposition
from clawrl.environments import tools
from clawrl.environments.backend import WORKSPACE, IsolationUnavailable, SandboxBackend
from clawrl.environments.leases import LeaseError, LeasePool, PoolExhausted
from clawrl.environments.metrics import EnvironmentsMetrics
from clawrl.environments.protocol import (
    AllocateRequest,
    EvaluateRequest,
    ExecToolRequest,
    LeaseRequest,
    ResetRequest,
    user_message,
)
from clawrl.environments.settings import EnvironmentsSettings

log = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/healthz", "/metrics"}
RETRY_AFTER_S = 5
Body = TypeVar("Body", bound=BaseModel)


class TooLarge(LeaseError):
    status, code = 413, "TOO_LARGE"


class Unauthorized(LeaseError):
    status, code = 401, "UNAUTHORIZED"


@dataclass
class Service:
    """What the routes share, built by the lifespan."""

    settings: EnvironmentsSettings
    backend: SandboxBackend
    pool: LeasePool
    metrics: EnvironmentsMetrics
    token: str | None


# leases.backend -> the module under clawrl.environments with `create_backend(settings)`.
BACKEND_MODULES = {"kubernetes": "kube"}


def make_backend(settings: EnvironmentsSettings) -> SandboxBackend:
    """The configured backend: local, or a module's `create_backend(settings)`."""
    if settings.leases.backend == "local":
        from clawrl.environments.local import LocalBackend

        return LocalBackend(settings.sandbox)
    name = BACKEND_MODULES.get(settings.leases.backend, settings.leases.backend)
    module = importlib.import_module(f"clawrl.environments.{name}")
    return module.create_backend(settings)


def error_response(exc: Exception) -> JSONResponse:
    """The one mapping from a refused request to HTTP."""
    if isinstance(exc, LeaseError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, PoolExhausted) else None
        body = {"ok": False, "error": str(exc), "code": exc.code}
        return JSONResponse(body, status_code=exc.status, headers=headers)
    body = {"ok": False, "error": f"internal error: {type(exc).__name__}", "code": "INTERNAL"}
    return JSONResponse(body, status_code=500)


def validation_message(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


async def parse(request: Request, model: type[Body], max_bytes: int) -> Body:
    """The request's JSON body as `model`; LeaseError (400/413) with a readable reason."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(f"request body over {max_bytes} bytes")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise TooLarge(f"request body over {max_bytes} bytes")
    try:
        data = json.loads(raw or b"null")
    except ValueError as exc:
        raise LeaseError(f"request body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise LeaseError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise LeaseError(validation_message(exc)) from exc


def authorize(service: Service, request: Request) -> None:
    if service.token is None or request.url.path in OPEN_PATHS:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {service.token}".encode()):
        raise Unauthorized("send 'Authorization: Bearer <token>' (environments_server.token)")


Handler = Callable[[Service, Any], Awaitable[dict[str, Any]]]


def add_route(app: FastAPI, path: str, model: type[BaseModel], handler: Handler) -> None:
    """POST `path`: authorize, parse into `model`, call handler, answer `{"ok": true, ...}`;
    every refusal goes through error_response and is counted and logged."""

    async def route(request: Request) -> Response:
        service: Service = request.app.state.service
        try:
            authorize(service, request)
            body = await parse(request, model, service.settings.environments_server.max_body_bytes)
            return JSONResponse({"ok": True, **await handler(service, body)})
        except LeaseError as exc:
            service.metrics.request_errors.labels(path, exc.code).inc()
            log.info("%s refused (%s): %s", path, exc.code, exc)
            return error_response(exc)
        except Exception as exc:
            service.metrics.request_errors.labels(path, "INTERNAL").inc()
            log.exception("%s failed", path)
            return error_response(exc)

    app.add_api_route(path, route, methods=["POST"], name=path.strip("/"))


async def allocate(service: Service, body: AllocateRequest) -> dict[str, Any]:
    lease, reused = await service.pool.allocate(body.task_key, body.request_id)
    return {
        "lease_id": lease.lease_id,
        "reused": reused,
        "task_key": lease.task_key,
        "request_id": body.request_id,
        "expires_in_s": service.pool.expires_in(lease),
    }


async def heartbeat(service: Service, body: LeaseRequest) -> dict[str, Any]:
    lease = await service.pool.heartbeat(body.lease_id)
    return {"expires_in_s": service.pool.expires_in(lease)}


async def reset(service: Service, body: ResetRequest) -> dict[str, Any]:
    if body.run_ctx:
        log.info("reset lease %s run_ctx=%s", body.lease_id, json.dumps(body.run_ctx)[:300])
    await service.pool.reset(body.lease_id, body.task_meta, body.task_timeouts)
    return {
        "user_msg": user_message(body.task_meta),
        "tool_schemas": tools.tool_schemas(),
        "tools": list(body.task_meta.tools),
        "workspace": WORKSPACE,
    }


async def exec_tool(service: Service, body: ExecToolRequest) -> dict[str, Any]:
    call = body.tool_call
    observation, result = await service.pool.exec_tool(body.lease_id, call.name, call.arguments)
    return {"observation": observation, "result": asdict(result) if result else None}


async def evaluate(service: Service, body: EvaluateRequest) -> dict[str, Any]:
    verdict = await service.pool.evaluate(body.lease_id, body.checker, body.timeout_s)
    return {
        "score": verdict.score,
        "passed": verdict.passed,
        "exit_code": verdict.result.exit_code,
        "output": verdict.output,
        "timed_out": verdict.result.timed_out,
        "duration_s": verdict.result.duration_s,
    }


async def close(service: Service, body: LeaseRequest) -> dict[str, Any]:
    return {"found": await service.pool.close(body.lease_id)}


@contextlib.asynccontextmanager
async def running(
    settings: EnvironmentsSettings, backend: SandboxBackend | None = None
) -> AsyncIterator[Service]:
    """Probe the backend (IsolationUnavailable stops the start), reclaim leftovers, reap."""
    metrics = EnvironmentsMetrics()
    backend = backend or make_backend(settings)
    try:
        await backend.probe()
    except IsolationUnavailable as exc:
        log.critical("refusing to start: %s", exc)
        raise
    pool = LeasePool(
        backend,
        settings.leases,
        settings.sandbox_limits.limits(),
        settings.sandbox_max_limits.limits(),
        metrics,
    )
    removed = await pool.reclaim_leftovers()
    if removed:
        log.warning("removed %d leftover sandboxes of an earlier process", removed)
    token = settings.environments_server.bearer_token()
    reaper = asyncio.create_task(pool.run_reaper())
    try:
        yield Service(settings, backend, pool, metrics, token)
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        await pool.shutdown()
        await backend.aclose()


def create_app(settings: EnvironmentsSettings, backend: SandboxBackend | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running(settings, backend) as service:
            app.state.service = service
            yield

    app = FastAPI(title="clawrl environments", lifespan=lifespan)
    add_route(app, "/allocate", AllocateRequest, allocate)
    add_route(app, "/heartbeat", LeaseRequest, heartbeat)
    add_route(app, "/reset", ResetRequest, reset)
    add_route(app, "/exec_tool", ExecToolRequest, exec_tool)
    add_route(app, "/evaluate", EvaluateRequest, evaluate)
    add_route(app, "/close", LeaseRequest, close)

    async def health(request: Request) -> dict[str, Any]:
        service: Service = request.app.state.service
        pool = service.pool.status()
        return {
            "ok": True,
            "backend": service.backend.name,
            "active_leases": pool["active_leases"],
            "max_leases": pool["max_leases"],
        }

    async def status(request: Request) -> Response:
        service: Service = request.app.state.service
        try:
            authorize(service, request)
        except LeaseError as exc:
            service.metrics.request_errors.labels("/status", exc.code).inc()
            log.info("/status refused (%s): %s", exc.code, exc)
            return error_response(exc)
        return JSONResponse({"ok": True, "pool": service.pool.status()})

    async def metrics(request: Request) -> Response:
        body, content_type = exposition(request.app.state.service.metrics.registry)
        return Response(body, media_type=content_type)

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/healthz", health, methods=["GET"])
    app.add_api_route("/status", status, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app
