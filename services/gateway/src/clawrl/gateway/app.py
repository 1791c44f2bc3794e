"""The HTTP layer: a FastAPI app whose lifespan builds every client (Redis, engine, tokenizer,
the GatewayControl gRPC server, the idle sweeper) from the settings, and thin routes over the
serving core. Every failure leaves through `errors.to_http`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from redis.asyncio import Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError
from redis.retry import Retry
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from clawrl.common import redis_client
from clawrl.common.chat import ChatRenderer
from clawrl.common.metrics import GarbageCollection, exposition
from clawrl.common.models import context_length, resolve_model_dir, served_model_name
from clawrl.common.served import read_served, read_served_tenants
from clawrl.common.sglang_client import EngineError, SGLangClient
from clawrl.gateway.anthropic_messages import MessageEvents, message_object, parse_messages_request
from clawrl.gateway.control import Admission, PauseGate, start_control_server
from clawrl.gateway.conversations import ConversationStore, StoredConversation
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
from clawrl.gateway.feedback import FeedbackService
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.openai_responses import (
    ResponsesRequest,
    continued,
    parse_responses_request,
    stored_messages,
)
from clawrl.gateway.openai_responses_output import ResponseEvents, response_body
from clawrl.gateway.protocol import ChatRequest, api_credential, parse_chat_request
from clawrl.gateway.recording import Recorder
from clawrl.gateway.serving import ChatService, OpenStream
from clawrl.gateway.sessions import SessionStore
from clawrl.gateway.settings import GatewaySettings
from clawrl.gateway.spool import RecordingSpool
from clawrl.gateway.tenants import identify

log = logging.getLogger(__name__)

CHAT_ROUTE = "/v1/chat/completions"
RESPONSES_ROUTE = "/v1/responses"
MESSAGES_ROUTE = "/v1/messages"
SERVED = (CHAT_ROUTE, RESPONSES_ROUTE, MESSAGES_ROUTE)  # answered ahead of FastAPI
FEEDBACK_ROUTE = "/v1/feedback"
ROUTES = (*SERVED, "/v1/models", "/healthz", "/readyz", "/metrics", FEEDBACK_ROUTE)
JSON = "application/json"


@dataclass
class Gateway:
    """What the lifespan built; routes reach it through `request.app.state.gateway`."""

    settings: GatewaySettings
    service: ChatService
    engine: SGLangClient
    redis: Redis
    gate: PauseGate
    metrics: GatewayMetrics
    api_keys: tuple[bytes, ...]
    model_name: str
    context_length: int
    started: int
    control_port: int = 0
    conversations: ConversationStore | None = None  # what previous_response_id continues
    feedback: FeedbackService | None = None  # None: feedback.enabled is false


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
    history, session_id = [], None
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
    save = store_response(gateway, request) if request.store else None
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


def store_response(gateway: Gateway, request: ResponsesRequest):
    async def save(done) -> None:
        session_id = done.headers.get("X-Session-Id") or request.chat.session.session_id
        conversation = StoredConversation(
            request.chat.session.owner, session_id, stored_messages(request, done)
        )
        await gateway.conversations.save(done.request_id, conversation)

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


async def initial_admission(
    settings: GatewaySettings, engine: SGLangClient, redis: Redis
) -> Admission:
    """What a starting replica serves: the configured version, else the LoRA version the last
    sync recorded, else (full weights) initial_policy_version."""
    if settings.control.initial_policy_version is not None:
        return Admission(settings.control.initial_policy_version)
    try:
        served = await asyncio.wait_for(read_served(redis, settings.control.served_key), 5)
    except (RedisError, TimeoutError, ValueError) as exc:
        log.warning("cannot read the served version at %s: %s", settings.control.served_key, exc)
        served = None
    if served is not None and served.adapter:
        return Admission(served.version, served.adapter)
    return Admission(await initial_policy_version(settings, engine))


async def restore_tenant_adapters(settings: GatewaySettings, redis: Redis, gate: PauseGate) -> None:
    """Per-tenant mode: route each tenant to the adapter its last sync recorded, so a replica
    that (re)starts does not serve tenants the shared policy's. A tenant no longer selected
    (taken out of tenants.allow/pattern) is left to the shared policy: its frozen adapter
    would record versions the trainer no longer trains."""
    if not settings.tenants.per_tenant or settings.control.initial_policy_version is not None:
        return
    key = settings.control.served_key
    try:
        served = await asyncio.wait_for(read_served_tenants(redis, key), 5)
    except (RedisError, TimeoutError) as exc:
        log.warning("cannot read the tenants' served adapters beside %s: %s", key, exc)
        return
    for tenant, mine in served.items():
        if not settings.tenants.owns_adapter(tenant):
            log.warning("tenant %s is no longer selected for an adapter: serving it the shared "
                        "policy, not its recorded %s", tenant, mine.adapter)  # fmt: skip
            continue
        gate.tenant_adapters[tenant] = (mine.version, mine.adapter)
        gate.metrics.tenant_policy_version.labels(tenant).set(mine.version)


async def initial_policy_version(settings: GatewaySettings, engine: SGLangClient) -> int:
    """The configured initial version, else the engine's weight_version when it is a number
    (a replica restarted after a weight sync then starts at the right version), else 0."""
    if settings.control.initial_policy_version is not None:
        return settings.control.initial_policy_version
    version = await engine_policy_version(engine)
    return 0 if version is None else version


async def engine_policy_version(engine: SGLangClient) -> int | None:
    """The engine's weight_version when it is an integer; None when it names its weights
    otherwise or does not answer within 5 s."""
    try:
        info = await asyncio.wait_for(engine.get_model_info(), 5)
        return int(info.get("weight_version"))
    except (EngineError, TimeoutError, TypeError, ValueError):
        return None


def create_redis(settings: GatewaySettings) -> Redis:
    # One quick retry at most: with Redis down, recording must fail fast, not stall serving.
    return redis_client.connect(
        settings.redis,
        socket_timeout=settings.redis.socket_timeout_s,
        socket_connect_timeout=settings.redis.socket_timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
        health_check_interval=30,
    )


def open_spool(settings: GatewaySettings) -> RecordingSpool | None:
    """The recording spool of this gateway: one directory per HTTP port, so a gateway restarted
    on its port replays what it left, and two on one host never share one."""
    if settings.sessions.spool_dir is None:
        return None
    directory = settings.sessions.spool_dir / f"port-{settings.serving.port}"
    return RecordingSpool(directory, settings.sessions.spool_max_bytes)


def create_app(settings: GatewaySettings, renderer: ChatRenderer | None = None) -> GatewayApp:
    """The gateway app; `renderer` may be passed in to share one tokenizer load (tests)."""
    metrics = GatewayMetrics()  # this app's own registry

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        model_dir = resolve_model_dir(settings.model)
        chat = renderer or await asyncio.to_thread(ChatRenderer.from_settings, settings.model)
        engine = SGLangClient(
            settings.serving.engine_url,
            timeout_s=settings.serving.engine_timeout_s,
            connect_timeout_s=settings.serving.engine_connect_timeout_s,
            max_connections=settings.serving.engine_max_connections,
        )
        redis = create_redis(settings)
        initial = await initial_admission(settings, engine, redis)
        gate = PauseGate(
            metrics,
            hold_timeout_s=settings.control.hold_timeout_s,
            retry_after_s=settings.serving.retry_after_s,
            policy_version=initial.policy_version,
            adapter=initial.adapter,
            lease_s=settings.control.lease_s,
            base_version=settings.control.initial_policy_version or 0,
            engine_version=lambda: engine_policy_version(engine),
        )
        await restore_tenant_adapters(settings, redis, gate)
        store = SessionStore(
            redis,
            prefix=settings.sessions.key_prefix,
            stream=settings.redis.turns_stream,
            shards=settings.redis.shards(),
            maxlen=settings.redis.stream_maxlen,
            ttl_s=settings.sessions.ttl_s,
            dedupe_ttl_s=settings.sessions.dedupe_ttl_s,
            feedback_ttl_s=settings.feedback.ttl_s if settings.feedback.enabled else 0,
        )
        recorder = Recorder(
            store,
            metrics,
            gateway_id=settings.gateway_id,
            anonymous_matching=settings.sessions.anonymous_matching,
            idle_timeout_s=settings.sessions.idle_timeout_s,
            sweep_interval_s=settings.sessions.sweep_interval_s,
            sweep_batch=settings.sessions.sweep_batch,
            spool=open_spool(settings),
            replay_interval_s=settings.sessions.spool_replay_interval_s,
        )
        name = served_model_name(settings.model)
        window = context_length(settings.model, model_dir)
        service = ChatService(
            renderer=chat,
            engine=engine,
            gate=gate,
            metrics=metrics,
            recorder=recorder,
            model_name=name,
            context_length=window,
            default_turn_type=settings.serving.default_turn_type,
            tool_call_parser=settings.serving.tool_call_parser,
            default_max_tokens=settings.serving.default_max_tokens,
            offload_render_chars=settings.serving.offload_render_chars,
            retry_after_s=settings.serving.retry_after_s,
        )
        token = settings.control.token.get_secret_value() if settings.control.token else None
        control, control_port = await start_control_server(
            gate,
            host=settings.control.host,
            port=settings.control.port,
            token=token,
            gateway_id=settings.gateway_id,
            drain_timeout_s=settings.control.drain_timeout_s,
        )
        sweeper = asyncio.create_task(recorder.sweep_forever(), name="idle-sweeper")
        replayer = asyncio.create_task(recorder.replay_forever(), name="spool-replay")
        collector = GarbageCollection("gateway")
        collector.install(metrics.registry)
        frozen = collector.freeze()
        app.state.gateway = Gateway(
            settings=settings,
            service=service,
            engine=engine,
            redis=redis,
            gate=gate,
            metrics=metrics,
            api_keys=tuple(key.encode() for key in settings.api_keys()),
            model_name=name,
            context_length=window,
            started=int(time.time()),
            control_port=control_port,
            conversations=ConversationStore(
                redis,
                metrics,
                prefix=settings.sessions.key_prefix,
                ttl_s=settings.sessions.ttl_s,
                retry_after_s=settings.serving.retry_after_s,
            ),
            feedback=FeedbackService(redis, store, settings.feedback, metrics)
            if settings.feedback.enabled
            else None,
        )
        log.info(
            "gateway %s serving %s (context %d, policy v%d%s) from %s; control gRPC on port %d; "
            "%d start-up objects frozen out of garbage collection",
            settings.gateway_id,
            name,
            window,
            gate.policy_version,
            f", adapter {gate.adapter}" if gate.adapter else "",
            settings.serving.engine_url,
            control_port,
            frozen,
        )
        try:
            yield
        finally:
            collector.uninstall(metrics.registry)
            sweeper.cancel()
            replayer.cancel()
            await recorder.drain()  # writes whose clients left: recorded, or spooled below
            if recorder.spool is not None:
                await recorder.replay_spool()  # what Redis takes now need not wait for a restart
                recorder.spool.close()
            await control.stop(grace=2)
            await engine.aclose()
            await redis.aclose()
            service.close()

    app = FastAPI(title="clawrl gateway", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            return error_response(MethodNotAllowed(f"method {request.method} not allowed here"))
        return error_response(NotFound(f"no route {request.method} {request.url.path}"))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        try:
            authorize(gateway, request.headers)
        except GatewayError as exc:
            return error_response(exc)
        return json_response({"object": "list", "data": [model_card(gateway)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        gateway: Gateway = request.app.state.gateway
        try:
            authorize(gateway, request.headers)
            if model_id != gateway.model_name:
                raise NotFound(f"The model '{model_id}' does not exist", code="model_not_found")
        except GatewayError as exc:
            return error_response(exc)
        return json_response(model_card(gateway))

    @app.post(FEEDBACK_ROUTE)
    async def feedback(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        try:
            authorize(gateway, request.headers)
            if gateway.feedback is None:
                raise NotFound("feedback is off on this gateway (feedback.enabled = false)")
            limit = gateway.settings.serving.max_body_bytes
            posted = await read_body(request.receive, request.headers, limit)
            body = await gateway.feedback.handle(posted, request.headers)
        except Exception as exc:
            if isinstance(exc, PayloadTooLarge):
                oversized(gateway, FEEDBACK_ROUTE)
            return error_response(exc, gateway.settings.serving.retry_after_s)
        return json_response(body)

    @app.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    @app.get("/readyz")
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

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        payload, content_type = exposition(request.app.state.gateway.metrics.registry)
        return Response(payload, media_type=content_type)

    return GatewayApp(app, metrics)


def model_card(gateway: Gateway) -> dict:
    return {
        "id": gateway.model_name,
        "object": "model",
        "created": gateway.started,
        "owned_by": "clawrl",
        "max_model_len": gateway.context_length,
    }
