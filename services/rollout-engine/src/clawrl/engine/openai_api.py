"""OpenAI-compatible routes of the CPU engine: /v1/models and /v1/chat/completions (a LoRA
adapter named by `lora_path` or by `model` written `base-model:adapter-name`, as in SGLang).

Prompts are rendered with clawrl.common.chat.ChatRenderer (the same renderer the gateway uses),
so the ids generated from are exactly the ones the gateway would send to /generate. Tool calls
are not parsed out of the answer: the assistant text comes back as `content`.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from clawrl.common.chat import ChatTemplateError
from clawrl.engine.generation import GenerationState
from clawrl.engine.lora import model_adapter
from clawrl.engine.protocol import (
    ChatCompletionRequest,
    RequestError,
    chat_generation_request,
    parse,
)


def finish_reason(state: GenerationState) -> str | None:
    """OpenAI's finish_reason from SGLang's."""
    if state.finish is None:
        return None
    return {"length": "length", "stop": "stop"}.get(state.finish["type"], "abort")


def _token_entry(token_text, token_id: int, logprob: float) -> dict[str, Any]:
    token = token_text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def choice_logprobs(state: GenerationState, token_text, start: int) -> dict[str, Any] | None:
    """OpenAI `logprobs.content` for output tokens [start:]."""
    req = state.request
    if not req.return_logprob:
        return None
    content = []
    for i in range(start, len(state.output_logprobs)):
        entry = _token_entry(token_text, state.output_ids[i], state.output_logprobs[i])
        tops = state.output_top[i] if i < len(state.output_top) else []
        entry["top_logprobs"] = [_token_entry(token_text, tid, lp) for lp, tid in tops]
        content.append(entry)
    return {"content": content}


def usage(state: GenerationState) -> dict[str, int]:
    prompt, completion = len(state.request.input_ids), len(state.output_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def build_router(app_state) -> APIRouter:
    """Routes bound to the app's engine, renderer and served model name."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict:
        """The base model, then each loaded LoRA adapter as SGLang lists it: id = its name,
        root = its path, parent = the base model."""
        engine = app_state.engine

        def card(model_id: str, root: str, parent: str | None, max_len: int | None) -> dict:
            return {
                "id": model_id,
                "object": "model",
                "created": app_state.started,
                "owned_by": "clawrl",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
            }

        base = app_state.served_name
        cards = [card(base, base, None, engine.context_length)]
        cards += [card(name, path, base, None) for name, path in engine.lora.loaded().items()]
        return {"object": "list", "data": cards}

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        engine = app_state.engine
        body = parse(ChatCompletionRequest, await _json(request))
        try:
            prompt_ids = app_state.renderer.render_ids(body.messages, body.tools)
        except ChatTemplateError as exc:
            raise RequestError(str(exc)) from exc
        gen = chat_generation_request(body, prompt_ids, app_state.limits, model_adapter(body.model))
        gen = await engine.resolve_adapter(gen)
        created = int(time.time())
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        model = body.model or app_state.served_name
        if not body.stream:
            state = await engine.generate_once(gen)
            message = {"role": "assistant", "content": state.text}
            return {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": choice_logprobs(state, engine.token_text, 0),
                        "finish_reason": finish_reason(state),
                    }
                ],
                "usage": usage(state),
                "metadata": {"weight_version": state.weight_version},
            }
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        states = engine.generate(gen)  # queued now: a full queue is a 503, not a broken stream
        return StreamingResponse(
            _chat_stream(engine, states, cid, created, model, include_usage),
            media_type="text/event-stream",
        )

    return router


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from exc


def _chunk(cid: str, created: int, model: str, choices: list, **extra) -> str:
    body = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }
    return f"data: {json.dumps(body)}\n\n"


async def _chat_stream(engine, states, cid, created, model, include_usage) -> AsyncIterator[str]:
    async with contextlib.aclosing(states):
        async for chunk in _chat_chunks(engine, states, cid, created, model, include_usage):
            yield chunk


async def _chat_chunks(engine, states, cid, created, model, include_usage) -> AsyncIterator[str]:
    yield _chunk(cid, created, model, [{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    sent_text, sent_tokens = 0, 0
    state = None
    async for state in states:
        delta = state.text[sent_text:]
        if delta or state.finished:
            choice = {
                "index": 0,
                "delta": {"content": delta} if delta else {},
                "logprobs": choice_logprobs(state, engine.token_text, sent_tokens),
                "finish_reason": finish_reason(state),
            }
            yield _chunk(cid, created, model, [choice])
            sent_tokens = len(state.output_logprobs)
            sent_text = len(state.text)
    if include_usage and state is not None:
        yield _chunk(cid, created, model, [], usage=usage(state))
    yield "data: [DONE]\n\n"


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """OpenAI's error shape, used by every route of the engine."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )
