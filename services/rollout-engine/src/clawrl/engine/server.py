"""SGLang's native HTTP API over the CPU engine. Routes parse, call the engine, and shape the
reply; errors become HTTP statuses in one place (`_install_error_handlers`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from clawrl.common.chat import ChatRenderer
from clawrl.common.metrics import GarbageCollection, exposition
from clawrl.common.models import served_model_name
from clawrl.engine.cpu.engine import CpuEngine, UpdateResult
from clawrl.engine.cpu.scheduler import QueueFullError
from clawrl.engine.generation import (
    GenerationRequest,
    GenerationState,
    SamplingRow,
    StopCriteria,
)
from clawrl.engine.lora import AdapterNotLoaded
from clawrl.engine.lora_api import build_lora_router
from clawrl.engine.metrics import EngineMetrics
from clawrl.engine.openai_api import build_router, error_response
from clawrl.engine.protocol import (
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    Limits,
    PauseGenerationRequest,
    RequestError,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    describe_validation_error,
    generation_request,
    parse,
)
from clawrl.engine.responses import Sent, generate_response
from clawrl.engine.settings import EngineSettings

log = logging.getLogger(__name__)

VERSION = "clawrl-cpu-0.1.0"


@dataclass
class AppState:
    """What the routes share; filled in by the lifespan once the model is loaded."""

    settings: EngineSettings
    metrics: EngineMetrics
    served_name: str
    started: int = field(default_factory=lambda: int(time.time()))
    engine: Any = None  # CpuEngine
    renderer: ChatRenderer | None = None
    limits: Limits | None = None


def weights_reply(result: UpdateResult) -> JSONResponse:
    """A weight call's `{success, message}`; 400 when it failed, as SGLang answers."""
    return JSONResponse(
        {
            "success": result.success,
            "message": result.message,
            "num_paused_requests": result.num_paused_requests,
        },
        status_code=200 if result.success else 400,
    )


def create_app(settings: EngineSettings) -> FastAPI:
    served_name = served_model_name(settings.model)
    state = AppState(settings, EngineMetrics(served_name), served_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await CpuEngine.load(settings, state.metrics)
        state.engine = engine
        state.renderer = ChatRenderer.for_tokenizer(
            engine.tokenizer,
            settings.model.chat_template,
            sanitize_control_tokens=settings.model.sanitize_control_tokens,
        )
        state.limits = Limits(
            vocab_size=engine.vocab_size,
            context_length=engine.context_length,
            default_max_new_tokens=settings.engine.default_max_new_tokens,
            eos_token_ids=engine.eos_token_ids,
        )
        collector = GarbageCollection("engine")
        collector.install(state.metrics.registry)
        frozen = collector.freeze()  # the model and torch: no full collection rescans them
        log.info(
            "serving %s on %s:%d (%d start-up objects frozen out of garbage collection)",
            served_name,
            settings.engine.host,
            settings.engine.port,
            frozen,
        )
        try:
            yield
        finally:
            collector.uninstall(state.metrics.registry)
            await engine.close()

    app = FastAPI(title="clawrl CPU engine (SGLang API)", lifespan=lifespan)
    app.state.clawrl = state
    _install_error_handlers(app, state.metrics)
    _add_native_routes(app, state)
    app.include_router(build_lora_router(state, _body))
    app.include_router(build_router(state))
    return app


def _install_error_handlers(app: FastAPI, metrics: EngineMetrics) -> None:
    @app.exception_handler(RequestError)
    async def bad_request(request: Request, exc: RequestError) -> JSONResponse:
        reason = "adapter_not_loaded" if isinstance(exc, AdapterNotLoaded) else "invalid"
        metrics.rejected_requests.labels(reason=reason).inc()
        log.info("rejected %s: %s", request.url.path, exc)
        return error_response(400, str(exc), "BadRequestError")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected_requests.labels(reason="invalid").inc()
        return error_response(400, describe_validation_error(exc), "BadRequestError")

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        metrics.rejected_requests.labels(reason="queue_full").inc()
        log.warning("queue full, rejected %s: %s", request.url.path, exc)
        return error_response(503, f"the engine is overloaded: {exc}", "ServiceUnavailableError")


async def _body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from exc


def _add_native_routes(app: FastAPI, state: AppState) -> None:
    """SGLang's native routes, by family. The engine is read from `state` per request: the
    lifespan sets it after the routes are added."""
    _add_health_routes(app, state)
    _add_generate_route(app, state)
    _add_weight_routes(app, state)
    _add_control_routes(app, state)
    _add_info_routes(app, state)


def _add_health_routes(app: FastAPI, state: AppState) -> None:
    """Liveness, and readiness to generate (one token)."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        # While paused (a weight sync in progress) the engine is healthy but must not
        # generate: a liveness probe here must not restart the pod or wait on the pause.
        if state.engine.paused:
            return Response(status_code=200)
        probe = GenerationRequest(
            input_ids=[(state.engine.eos_token_ids and min(state.engine.eos_token_ids)) or 0],
            sampling=SamplingRow(temperature=0.0),
            stop=StopCriteria(max_new_tokens=1),
        )
        try:
            await asyncio.wait_for(
                state.engine.generate_once(probe), state.settings.engine.health_generate_timeout_s
            )
        except (TimeoutError, QueueFullError) as exc:
            log.warning("health_generate failed: %r", exc)
            return Response(status_code=503)
        return Response(status_code=200)


def _add_generate_route(app: FastAPI, state: AppState) -> None:
    """/generate, whole or streamed (server-sent events)."""

    @app.post("/generate")
    async def generate(request: Request):
        body = parse(GenerateRequest, await _body(request))
        tokenizer = state.engine.tokenizer
        gen = generation_request(body, tokenizer.encode, state.limits)
        gen = await state.engine.resolve_adapter(gen)
        if gen.stream:
            # Queue now, so a full queue is a 503 rather than a broken stream.
            states = state.engine.generate(gen)
            incremental = state.settings.engine.incremental_streaming_output
            return StreamingResponse(
                _generate_events(state.engine, states, incremental), media_type="text/event-stream"
            )
        result = await state.engine.generate_once(gen)
        return generate_response(result, state.engine.token_text)


def _add_weight_routes(app: FastAPI, state: AppState) -> None:
    """Weight updates: from disk, or broadcast to a group inside a weight-update session."""

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = parse(UpdateWeightsFromDiskRequest, await _body(request))
        if body.abort_all_requests:
            await state.engine.abort_all()
        result = await state.engine.update_weights_from_disk(
            body.model_path, body.weight_version, body.load_format
        )
        return weights_reply(result)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = parse(InitWeightsUpdateGroupRequest, await _body(request))
        result = await state.engine.init_weights_update_group(
            body.master_address, body.master_port, body.rank_offset, body.world_size,
            body.group_name, body.backend,
        )  # fmt: skip
        return weights_reply(result)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = parse(UpdateWeightsFromDistributedRequest, await _body(request))
        if body.abort_all_requests:
            await state.engine.abort_all()
        result = await state.engine.update_weights_from_distributed(
            body.names, body.dtypes, body.shapes, body.group_name, body.weight_version
        )
        return weights_reply(result)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = parse(DestroyWeightsUpdateGroupRequest, await _body(request))
        return weights_reply(await state.engine.destroy_weights_update_group(body.group_name))

    # SGLang's weight-update session: /update_weights_from_distributed only inside one.
    @app.post("/begin_weight_update")
    async def begin_weight_update() -> JSONResponse:
        return weights_reply(state.engine.begin_weight_update())

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        return weights_reply(state.engine.end_weight_update())


def _add_control_routes(app: FastAPI, state: AppState) -> None:
    """Pausing and continuing generation; flushing the prefix cache."""

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        body = parse(PauseGenerationRequest, await _body(request))
        await state.engine.pause(body.mode)
        log.info("generation paused (mode=%s)", body.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        await state.engine.resume()
        log.info("generation continued")
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if not await state.engine.flush_cache():
            # SGLang's answer: a flush would pull KV from under running requests.
            return PlainTextResponse(
                "Cache not flushed. Please check backend logs for more details. (When there "
                "are running or waiting requests, the operation will not be performed.)",
                status_code=400,
            )
        return PlainTextResponse("Cache flushed.")


def _add_info_routes(app: FastAPI, state: AppState) -> None:
    """What the engine serves and how, and its metrics."""

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        config = state.engine.runner.config
        return {
            "model_path": str(state.engine.model_dir),
            "tokenizer_path": str(state.engine.model_dir),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        s = state.settings
        return {
            "version": VERSION,
            "backend": "cpu",
            "model_path": str(state.engine.model_dir),
            "served_model_name": state.served_name,
            "context_length": state.engine.context_length,
            "weight_version": state.engine.weight_version,
            "max_running_requests": s.engine.max_running_requests,
            "max_queued_requests": s.engine.max_queued_requests,
            "max_total_tokens": s.engine.max_total_tokens,
            "enable_lora": s.engine.lora_enabled,
            "max_loras_per_batch": s.engine.max_loras_per_batch,
            "max_loaded_loras": s.engine.max_loaded_loras,
            "lora_eviction_policy": s.engine.lora_eviction_policy,
            "lora_drain_wait_threshold": s.engine.lora_drain_wait_threshold,
            "max_lora_rank": state.engine.max_lora_rank or None,
            "internal_states": [
                {
                    "num_running_reqs": state.engine.scheduler.num_running,
                    "num_queue_reqs": state.engine.scheduler.num_waiting,
                    "paused": state.engine.paused,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = exposition(state.metrics.registry)
        return Response(body, media_type=content_type)


async def _generate_events(
    engine: CpuEngine, states: AsyncIterator[GenerationState], incremental: bool
) -> AsyncIterator[str]:
    """SSE events of one streaming /generate, then `data: [DONE]`."""
    sent = Sent() if incremental else None
    async with contextlib.aclosing(states):
        async for result in states:
            reply = generate_response(result, engine.token_text, sent)
            if sent is not None:
                sent.advance(result)
            yield f"data: {json.dumps(reply)}\n\n"
    yield "data: [DONE]\n\n"
