"""The HTTP layer: a FastAPI app whose lifespan builds every client (Redis, engine, tokenizer,
the GatewayControl gRPC server, the idle sweeper) from the settings (lifespan.py), and thin
routes over the serving core. Every failure leaves through `errors.to_http`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Mapping

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from clawrl.common.chat import ChatRenderer
from clawrl.common.metrics import exposition
from clawrl.common.sglang_client import EngineError
from clawrl.gateway.anthropic_messages import MessageEvents, message_object, parse_messages_request
from clawrl.gateway.conversations import StoredConversation
from clawrl.gateway.errors import (
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    to_anthropic,
    to_http,
)
from clawrl.gateway.lifespan import Gateway, start_gateway
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.openai_responses import (
    ResponsesRequest,
    continued,
    parse_responses_request,
    stored_messages,
)
from clawrl.gateway.openai_responses_output import ResponseEvents, response_body
from clawrl.gateway.outcomes import OUTCOME_ROUTE
from clawrl.gateway.protocol import ChatRequest, api_credential, parse_chat_request
from clawrl.gateway.serving import OpenStream
from clawrl.gateway.settings import GatewaySettings
from clawrl.gateway.tenants import identify

log = logging.getLogger(__name__)

CHAT_ROUTE = "/v1/chat/completions"
RESPONSES_ROUTE = "/v1/responses"
MESSAGES_ROUTE = "/v1/messages"
SERVED = (CHAT_ROUTE, RESPONSES_ROUTE, MESSAGES_ROUTE)  # answered ahead of FastAPI
FEEDBACK_ROUTE = "/v1/feedback"
ROUTES = (*SERVED, "/v1/models", "/healthz", "/readyz", "/metrics", FEEDBACK_ROUTE, OUTCOME_ROUTE)
JSON = "application/json"


def json_response(body: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type=JSON, headers=headers)


def error_response(exc: BaseException, retry_after_s: int = 5, shape=to_http) -> Response:
    """The one way a failure becomes an HTTP response; `shape`: the API's error body
    (OpenAI's, or to_anthropic on the Anthropic route)."""
    if not isinstance(exc, GatewayError | EngineError):
        log.error("unexpected error: %s: %s", type(exc).__name__, exc, exc_info=exc)
    error = shape(exc, retry_after_s)
    return json_response(error.body, error.status, error.headers)


class SSEResponse(StreamingResponse):
    """Server-sent events whose stream is released however the response ends."""

    def __init__(self, stream: OpenStream):
        super().__init__(
            stream.lines,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._release = stream.release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()


async def read_body(receive: Receive, headers: Headers, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes: by its Content-Length before any of
    it is read, else (chunked) as soon as what arrived passes the limit."""
    too_large = PayloadTooLarge(
        f"the request body is larger than this gateway's limit of {limit} bytes "
        "(serving.max_body_bytes)"
    )
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class GatewayApp:
    """The ASGI app uvicorn serves. The generation routes (/v1/chat/completions,
    /v1/responses, /v1/messages) are answered here, ahead of FastAPI: the hot path skips the
    framework's routing, request objects and middleware stack, none of which it uses
    (measured at one client: a side turn 0.4-0.7 ms quicker than behind the middleware).
    Every other route, and the lifespan that builds the clients, is FastAPI's. Requests of
    every route are counted by route and status, with their latency up to the end of the body
    (streams included)."""

    def __init__(self, api: FastAPI, metrics: GatewayMetrics):
        self.api = api
        self.metrics = metrics
        # Every route's latency series exists (at zero) from the first scrape: a series born
        # with its first request has no earlier sample, so rate() over it shows nothing.
        for route in (*ROUTES, "other"):
            metrics.latency.labels(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.api(scope, receive, send)  # the lifespan
        path = scope["path"]
        route = path if path in ROUTES else "other"
        started = time.perf_counter()
        status = 500
        try:
            if path in SERVED:
                response = await self.respond(self.api.state.gateway, scope, receive, started)
                status = response.status_code
                await response(scope, receive, send)
            else:

                async def send_with_status(message):
                    nonlocal status
                    if message["type"] == "http.response.start":
                        status = message["status"]
                    await send(message)

                await self.api(scope, receive, send_with_status)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)

    async def respond(
        self, gateway: Gateway, scope: Scope, receive: Receive, started: float
    ) -> Response:
        path = scope["path"]
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"method {scope['method']} not allowed here")
            headers = Headers(scope=scope)
            authorize(gateway, headers)
            body = await read_body(receive, headers, gateway.settings.serving.max_body_bytes)
            if path == RESPONSES_ROUTE:
                return await respond_responses(gateway, body, headers, started)
            if path == MESSAGES_ROUTE:
                return await respond_messages(gateway, body, headers, started)
            chat = identify_tenant(gateway, headers, parse_chat_request(body, headers))
            if chat.stream:
                return SSEResponse(await gateway.service.open_stream(chat, started))
            response_body, response_headers = await gateway.service.complete(chat)
            return json_response(response_body, headers=response_headers)
        except Exception as exc:
            if isinstance(exc, PayloadTooLarge):
                oversized(gateway, path)
            shape = to_anthropic if path == MESSAGES_ROUTE else to_http
            return error_response(exc, gateway.settings.serving.retry_after_s, shape)


async def respond_responses(
    gateway: Gateway, body: bytes, headers: Headers, started: float
) -> Response:
    """/v1/responses: the stored conversation of previous_response_id in front of the input,
    served as the chat route serves; the response is stored (unless store=false) before the
    client sees its end, so its continuation always finds it."""
    request = parse_responses_request(body, headers)
    identify_tenant(gateway, headers, request.chat)
    history, session_id, stored = [], None, None
    if request.previous_response_id is not None:
        stored = await gateway.conversations.load(
            request.previous_response_id, request.chat.session.owner
        )
        if stored is None:
            raise InvalidRequest(
                f"Previous response with id '{request.previous_response_id}' not found: it is "
                "not a response of this API key, or it expired, or it was made with store=false",
                param="previous_response_id",
            )
        history, session_id = stored.messages, stored.session_id
    request = continued(request, history, session_id)
    save = store_response(gateway, request, stored) if request.store else None
    service = gateway.service
    if request.chat.stream:
        stream = await service.open_stream(
            request.chat, started, ResponseEvents.factory(request), save
        )
        return SSEResponse(stream)
    done = await service.generate(request.chat)
    if save is not None:
        await save(done)
    return json_response(response_body(request, done, service.model_name), headers=done.headers)


def oversized(gateway: Gateway, route: str) -> None:
    gateway.metrics.oversized_requests.labels(route).inc()
    log.warning("a request to %s was refused: its body is over serving.max_body_bytes (%d)",
                route, gateway.settings.serving.max_body_bytes)  # fmt: skip


def store_response(
    gateway: Gateway, request: ResponsesRequest, parent: StoredConversation | None = None
):
    """What stores a finished response (`parent`: the stored response it continues)."""

    async def save(done) -> None:
        session_id = done.headers.get("X-Session-Id") or request.chat.session.session_id
        conversation = StoredConversation(
            request.chat.session.owner, session_id, stored_messages(request, done)
        )
        await gateway.conversations.save(done.request_id, conversation, parent)

    return save


async def respond_messages(
    gateway: Gateway, body: bytes, headers: Headers, started: float
) -> Response:
    """/v1/messages: served as the chat route serves, in Anthropic's shapes."""
    chat = identify_tenant(gateway, headers, parse_messages_request(body, headers))
    service = gateway.service
    if chat.stream:
        return SSEResponse(await service.open_stream(chat, started, MessageEvents))
    done = await service.generate(chat)
    return json_response(message_object(chat, done, service.model_name), headers=done.headers)


def identify_tenant(gateway: Gateway, headers: Mapping[str, str], chat: ChatRequest) -> ChatRequest:
    """The request with its tenant set on its session (gateway/tenants.py)."""
    return identify(chat, gateway.settings.tenants, bool(gateway.api_keys), headers)


def authorize(gateway: Gateway, headers: Mapping[str, str]) -> None:
    """The API key as `Authorization: Bearer <key>` or (Anthropic's) `x-api-key: <key>`."""
    if not gateway.api_keys:
        return
    given = (api_credential(headers) or "").encode()
    if given and any(hmac.compare_digest(given, k) for k in gateway.api_keys):
        return
    how = "Send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
    raise Unauthorized(
        f"Incorrect API key provided. {how}" if given else f"You didn't provide an API key. {how}"
    )


def create_app(settings: GatewaySettings, renderer: ChatRenderer | None = None) -> GatewayApp:
    """The gateway app; `renderer` may be passed in to share one tokenizer load (tests)."""
    metrics = GatewayMetrics()  # this app's own registry

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        running = await start_gateway(settings, metrics, renderer)
        app.state.gateway = running.gateway
        try:
            yield
        finally:
            await running.stop()

    app = FastAPI(title="clawrl gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    add_routes(app)
    return GatewayApp(app, metrics)


def add_routes(app: FastAPI) -> None:
    """The routes FastAPI answers (the generation routes are GatewayApp's), in matching order."""
    app.add_exception_handler(StarletteHTTPException, http_exception)
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_api_route(FEEDBACK_ROUTE, feedback, methods=["POST"])
    app.add_api_route(OUTCOME_ROUTE, outcome, methods=["POST"])
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/readyz", readyz, methods=["GET"])
    app.add_api_route("/metrics", metrics_route, methods=["GET"])


async def http_exception(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 405:
        return error_response(MethodNotAllowed(f"method {request.method} not allowed here"))
    return error_response(NotFound(f"no route {request.method} {request.url.path}"))


# --- OpenAI's model list: the one policy model --------------------------------------------


async def models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        authorize(gateway, request.headers)
    except GatewayError as exc:
        return error_response(exc)
    return json_response({"object": "list", "data": [model_card(gateway)]})


async def model(request: Request, model_id: str) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        authorize(gateway, request.headers)
        if model_id != gateway.model_name:
            raise NotFound(f"The model '{model_id}' does not exist", code="model_not_found")
    except GatewayError as exc:
        return error_response(exc)
    return json_response(model_card(gateway))


def model_card(gateway: Gateway) -> dict:
    return {
        "id": gateway.model_name,
        "object": "model",
        "created": gateway.started,
        "owned_by": "clawrl",
        "max_model_len": gateway.context_length,
    }


# --- feedback -----------------------------------------------------------------------------


async def feedback(request: Request) -> Response:
    """POST /v1/feedback: a rating of one turn (feedback.py)."""
    off = "feedback is off on this gateway (feedback.enabled = false)"
    return await posted_to(request, FEEDBACK_ROUTE, "feedback", off)


async def outcome(request: Request) -> Response:
    """POST /v1/outcomes: an episode's outcome (outcomes.py)."""
    off = "episodes are off on this gateway (episodes.enabled = false)"
    return await posted_to(request, OUTCOME_ROUTE, "outcomes", off)


async def posted_to(request: Request, route: str, service: str, off: str) -> Response:
    """A JSON POST that the gateway's `service` (a FeedbackService or OutcomeService, None when
    switched off: 404 `off`) answers."""
    gateway: Gateway = request.app.state.gateway
    try:
        authorize(gateway, request.headers)
        handler = getattr(gateway, service)
        if handler is None:
            raise NotFound(off)
        limit = gateway.settings.serving.max_body_bytes
        posted = await read_body(request.receive, request.headers, limit)
        body = await handler.handle(posted, request.headers)
    except Exception as exc:
        if isinstance(exc, PayloadTooLarge):
            oversized(gateway, route)
        return error_response(exc, gateway.settings.serving.retry_after_s)
    return json_response(body)


# --- probes and metrics -------------------------------------------------------------------


async def healthz() -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Ready when the engine answers /health and reports its model (Redis is not needed
    to serve, so it is reported but does not gate readiness)."""
    gateway: Gateway = request.app.state.gateway
    try:
        healthy = await asyncio.wait_for(gateway.engine.health(), 5)
        info = await asyncio.wait_for(gateway.engine.get_model_info(), 5) if healthy else {}
    except (EngineError, TimeoutError):
        healthy, info = False, {}
    try:
        redis_ok = bool(await asyncio.wait_for(gateway.redis.ping(), 2))
    except Exception:
        redis_ok = False
    body = {
        "status": "ready" if healthy and info else "not ready",
        "engine": {"reachable": healthy, "model": info.get("model_path")},
        "redis": redis_ok,
        "paused": gateway.gate.paused,
        "policy_version": gateway.gate.policy_version,
    }
    return json_response(body, 200 if healthy and info else 503)


async def metrics_route(request: Request) -> Response:
    payload, content_type = exposition(request.app.state.gateway.metrics.registry)
    return Response(payload, media_type=content_type)
