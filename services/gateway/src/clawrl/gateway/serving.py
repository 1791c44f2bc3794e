"""The serving core: one chat completion from validated request to OpenAI response, streamed or
not. Renders the prompt once with the policy's tokenizer, generates from `input_ids` with
log-probs, reads tool calls, and hands main turns to the recorder. What the engine sampled is
generation.py's; each API's response format is its own module (chat_completions.py,
openai_responses_output.py, anthropic_messages.py), streamed through a `StreamEncoder`.

Ordering that matters: a main turn is stored in Redis *before* the client sees the end of the
response (the body, or `data: [DONE]`), so the client's next request always finds it pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from clawrl.common.chat import ChatRenderer
from clawrl.common.logs import log_context
from clawrl.common.sglang_client import SGLangClient, sampling_params
from clawrl.gateway.chat_completions import ChatChunks, chat_completion
from clawrl.gateway.control import Admission, PauseGate
from clawrl.gateway.errors import (
    ContextLengthExceeded,
    EngineBadReply,
    InvalidRequest,
    engine_error_kind,
)
from clawrl.gateway.generation import (
    Completion,
    Generation,
    HeldText,
    assistant_message,
    finish_reason,
    trim_stop_string,
)
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.protocol import ChatRequest
from clawrl.gateway.recording import Recorder, ServedTurn, TurnContext
from clawrl.gateway.tool_calls import Delta, StreamingToolCallParser, ToolCall, parse_tool_calls
from clawrl.gateway.versions import recorded_versions, turn_versions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenStream:
    """A started stream: its SSE lines, and `release`, which frees the engine connection and
    the pause gate's slot. The HTTP layer calls `release` when the response ends, however it
    ends: a stream the client never read still has to leave the gate (releasing twice is
    harmless)."""

    lines: AsyncIterator[bytes]
    release: Callable[[], Awaitable[None]]


class ChatService:
    """Everything between a validated request and its OpenAI response."""

    def __init__(
        self,
        *,
        renderer: ChatRenderer,
        engine: SGLangClient,
        gate: PauseGate,
        metrics: GatewayMetrics,
        recorder: Recorder | None,
        model_name: str,
        context_length: int,
        default_turn_type: str = "main",
        tool_call_parser: str = "hermes",
        default_max_tokens: int | None = None,
        offload_render_chars: int = 8192,
        retry_after_s: int = 5,
        episodes: bool = True,
    ) -> None:
        self.renderer = renderer
        self.episodes = episodes  # X-Episode marks turns (episodes.enabled)
        self.engine = engine
        self.gate = gate
        self.metrics = metrics
        self.recorder = recorder
        self.model_name = model_name
        self.context_length = context_length
        self.default_turn_type = default_turn_type
        self.tool_call_parser = tool_call_parser
        self.default_max_tokens = default_max_tokens
        self.offload_render_chars = offload_render_chars
        self.retry_after_s = retry_after_s
        self.stop_token_ids = renderer.eos_token_ids
        # What trim_stop_string reads sampled ids with (a renderer without a tokenizer: none).
        self.decode = self._decode if hasattr(renderer, "tokenizer") else None
        # One thread: big renders wait for each other rather than fight for the GIL.
        self._render_pool = ThreadPoolExecutor(1, thread_name_prefix="render")

    def close(self) -> None:
        self._render_pool.shutdown(wait=False, cancel_futures=True)

    def _decode(self, ids: list[int]) -> str:
        return self.renderer.tokenizer.decode(ids, skip_special_tokens=True)

    # --- preparing a request ------------------------------------------------------------

    async def prompt_ids(self, request: ChatRequest) -> list[int]:
        """The prompt, rendered and tokenised exactly once (in a thread when it is big)."""
        if request.input_chars > self.offload_render_chars:
            return await asyncio.get_running_loop().run_in_executor(
                self._render_pool,
                self.renderer.render_ids,
                request.render_messages,
                request.tools,
            )
        return self.renderer.render_ids(request.render_messages, request.tools)

    def max_new_tokens(self, request: ChatRequest, prompt_tokens: int) -> int:
        """The completion budget. Only a prompt that leaves no room is refused; a max_tokens
        beyond the window is clamped to what is left (agents often send the model's whole
        context length as max_tokens)."""
        room = self.context_length - prompt_tokens
        if room <= 0:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, your messages resulted in {prompt_tokens} tokens. Please reduce the "
                "length of the messages.",
                param="messages",
            )
        wanted = request.max_tokens or self.default_max_tokens or room
        return min(wanted, room)

    def payload(self, request: ChatRequest, prompt_ids: list[int]) -> dict[str, Any]:
        # presence/frequency penalties are accepted but not applied: they would make the
        # sampled tokens' log-probs differ from the policy's, and the turn is trained on them.
        if request.top_k != -1 and self.is_main(request):
            raise InvalidRequest(
                "top_k is only served on side turns (X-Turn-Type: side): a main turn is "
                "recorded for training, and its record keeps temperature and top_p only",
                param="top_k",
            )
        payload = {
            "input_ids": prompt_ids,
            "sampling_params": sampling_params(
                max_new_tokens=self.max_new_tokens(request, len(prompt_ids)),
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                stop=request.stop or None,
                stop_token_ids=self.stop_token_ids,
                seed=request.seed,
            ),
            "return_logprob": True,
            "return_text_in_logprobs": request.logprobs,
        }
        if request.top_logprobs:
            payload["top_logprobs_num"] = request.top_logprobs
        return payload

    def is_main(self, request: ChatRequest) -> bool:
        """Recorded as a main turn: main, or a probe (marked so, and never trained)."""
        return (request.session.turn_type or self.default_turn_type) in ("main", "probe")

    def _begin_turn(self, request: ChatRequest, request_id: str) -> TurnContext | None:
        if self.recorder is None or not self.is_main(request):
            return None
        return self.recorder.begin(
            request_id,
            request.session.session_id,
            request.render_messages,
            request.messages,
            scope=request.session.scope,
            done=request.session.session_done,
            api=request.api,
        )

    def _prepare_meanwhile(
        self, request: ChatRequest, turn: TurnContext | None, prompt_ids: list[int]
    ) -> None:
        """Have the turn's record prepared (its CPU work that needs only the request) once the
        engine call about to be awaited has written its request: two passes of the event loop
        on, the call's own and the one in which aiohttp's writer task writes. The work then
        overlaps the engine's instead of following its reply, and the call itself starts at
        once (no task of its own: none of its passes). A callback's failure is the loop's to
        log; the record then works it all out itself."""
        if turn is None or self.recorder is None:
            return
        loop = asyncio.get_running_loop()
        prepare = functools.partial(
            self.recorder.prepare,
            turn,
            model=self.model_name,
            tools=request.tools,
            prompt_ids=prompt_ids,
        )
        loop.call_soon(loop.call_soon, prepare)

    # --- building responses -------------------------------------------------------------

    def _count_tokens(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.prompt_length.observe(prompt_tokens)
        self.metrics.completion_tokens.inc(completion_tokens)

    def _completion(
        self,
        request_id: str,
        generation: Generation,
        content: str | None,
        calls: list[ToolCall],
        prompt_ids: list[int],
        admitted: Admission,
    ) -> Completion:
        """A finished generation as every API formats it, its tokens counted."""
        done = Completion(
            request_id=request_id,
            generation=generation,
            content=content,
            calls=calls,
            message=assistant_message(content, calls),
            finish=finish_reason(generation, calls),
            prompt_tokens=len(prompt_ids),
            policy_version=turn_versions(generation.weight_version, admitted)[0],
        )
        self._count_tokens(len(prompt_ids), len(generation.ids))
        return done

    def _engine_failed(self, exc: BaseException) -> None:
        kind = engine_error_kind(exc)
        if kind is not None:
            self.metrics.engine_errors.labels(kind).inc()
            log.warning("engine call failed: %s", exc)

    # --- recording ----------------------------------------------------------------------

    async def _record(
        self,
        request: ChatRequest,
        request_id: str,
        turn: TurnContext | None,
        prompt_ids: list[int],
        generation: Generation,
        message: dict[str, Any],
        finish_reason: str,
        admitted: Admission,
    ) -> dict[str, str]:
        """Store a main turn, or close the session of a side turn; response headers.
        `admitted`: the policy version (and adapter) the request was admitted under."""
        if self.recorder is None:
            return {}
        if turn is None:
            if request.session.session_done and request.session.session_id:
                await self.recorder.close(
                    request_id, request.session.session_id, request.session.scope
                )
            return {}
        # The engine's version at the end; a sync that retracted this generation made it newer
        # than the one it started under (the judge masks such mixed turns). With an adapter,
        # the adapter: it produced every token.
        versions = recorded_versions(
            generation.first_weight_version if generation.streamed else "",
            generation.weight_version,
            admitted,
            paused_since=self.gate.pauses != admitted.pauses,
            base_version=self.gate.base_version,
        )
        if versions.unknown_weights:
            self.metrics.unknown_weight_turns.inc()
            log.warning(
                "the engine served weights %r while the gateway routes v%d: turn %s recorded "
                "as unknown_weights (never trained); was the engine restarted?",
                versions.weight_version,
                admitted.policy_version,
                request_id,
            )
        served = ServedTurn(
            model=self.model_name,
            policy_version=versions.policy_version,
            admitted_policy_version=versions.started_version,
            weight_version=versions.weight_version,
            unknown_weights=versions.unknown_weights,
            messages=request.messages,
            tools=request.tools,
            prompt_ids=prompt_ids,
            response_ids=generation.ids,
            response_logprobs=generation.logprobs,
            response_text=generation.text,
            response_message=message,
            finish_reason=finish_reason,
            temperature=request.temperature,
            top_p=request.top_p,
            tenant=request.session.tenant,
            probe=request.session.turn_type == "probe",
            episode=request.session.episode and self.episodes,
        )
        turn_id = await self.recorder.finish(turn, served)
        headers = {"X-Session-Id": turn.session_id}
        if turn_id:
            headers["X-Turn-Id"] = turn_id
        return headers

    async def _abandon(
        self, request: ChatRequest, request_id: str, turn: TurnContext | None
    ) -> None:
        """A failed main request is still its session's next state; a failed request that said
        X-Session-Done still closes its session."""
        if self.recorder is None:
            return
        if turn is not None:
            await self.recorder.abandon(turn)
        elif request.session.session_done and request.session.session_id:
            await self.recorder.close(request_id, request.session.session_id, request.session.scope)

    # --- non-streaming ------------------------------------------------------------------

    async def generate(self, request: ChatRequest) -> Completion:
        """One whole generation, recorded (a main turn) before it is returned: the core every
        API's non-streamed response is formatted from."""
        prompt_ids = await self.prompt_ids(request)
        payload = self.payload(request, prompt_ids)
        request_id = new_request_id(request.api)
        turn = self._begin_turn(request, request_id)
        try:
            async with self.gate.admit(request.session.tenant) as admitted:
                self._prepare_meanwhile(request, turn, prompt_ids)
                reply = await self.engine.generate(routed(payload, admitted))
            generation = Generation()
            generation.update(reply)
        except Exception as exc:
            self._engine_failed(exc)
            await self._abandon(request, request_id, turn)
            raise
        trim_stop_string(generation, self.decode)
        content, calls = (
            parse_tool_calls(generation.text, self.tool_call_parser)
            if request.parse_tool_calls
            else (generation.text, [])
        )
        done = self._completion(request_id, generation, content, calls, prompt_ids, admitted)
        done.headers = await self._record(
            request, request_id, turn, prompt_ids, generation, done.message, done.finish, admitted
        )
        return done

    async def complete(self, request: ChatRequest) -> tuple[dict[str, Any], dict[str, str]]:
        """A whole chat completion and the response headers (session and turn ids)."""
        done = await self.generate(request)
        return chat_completion(done, self.model_name, request.logprobs), done.headers

    # --- streaming ----------------------------------------------------------------------

    async def open_stream(
        self,
        request: ChatRequest,
        started: float,
        encoder: EncoderFactory | None = None,
        on_complete: Callable[[Completion], Awaitable[None]] | None = None,
    ) -> OpenStream:
        """Start a streamed completion, its events encoded by `encoder` (chat-completion
        chunks by default); `on_complete` runs once it is recorded, before its last event.
        Everything that can fail with a proper HTTP status (validation, hold timeout, engine
        down) fails here, before the response starts."""
        prompt_ids = await self.prompt_ids(request)
        payload = self.payload(request, prompt_ids)
        request_id = new_request_id(request.api)
        turn = self._begin_turn(request, request_id)
        admission = contextlib.AsyncExitStack()
        events = None
        try:
            admitted = await admission.enter_async_context(self.gate.admit(request.session.tenant))
            events = self.engine.generate_stream(routed(payload, admitted))
            self._prepare_meanwhile(request, turn, prompt_ids)
            first = await anext(events)
        except BaseException as exc:
            if events is not None:
                await events.aclose()
            await admission.aclose()
            if isinstance(exc, StopAsyncIteration):
                exc = EngineBadReply("the engine's stream ended without an event")
            if isinstance(exc, Exception):
                self._engine_failed(exc)
                await self._abandon(request, request_id, turn)
            raise exc from None
        self.metrics.ttft.observe(time.perf_counter() - started)

        async def release() -> None:
            await events.aclose()
            await admission.aclose()

        async def end() -> None:
            await release()
            if turn is not None and self.recorder is not None:
                self.recorder.abandon_soon(turn)  # no-op unless the client left mid-stream

        stream = StreamState(
            request, request_id, turn, prompt_ids, admitted, Generation(streamed=True), on_complete
        )
        lines = self._sse(stream, first, events, release, (encoder or ChatChunks)(stream, self))
        return OpenStream(lines, end)

    async def _sse(
        self,
        stream: StreamState,
        first: dict[str, Any],
        events: AsyncIterator[dict[str, Any]],
        release: Callable[[], Awaitable[None]],
        encoder: StreamEncoder,
    ) -> AsyncIterator[bytes]:
        request = stream.request
        generation = stream.generation
        try:
            generation.update(first)
        except Exception as exc:
            await release()
            # Opening events first even so: strict clients (the openai SDK's stream helper)
            # refuse a stream whose first event is its failure.
            for piece in encoder.opening():
                yield piece
            yield await self._stream_failed(stream, exc, encoder)
            return
        parser = StreamingToolCallParser(
            self.tool_call_parser if request.parse_tool_calls else "none"
        )
        calls: list[ToolCall] = []
        content: list[str] = []
        held = HeldText.for_stops(request.stop)

        def pieces(deltas: list[Delta]) -> list[bytes]:
            out = []
            for delta in deltas:
                if delta.tool_call is not None:
                    calls.append(delta.tool_call)
                elif delta.content:
                    content.append(delta.content)
                else:
                    continue
                out += encoder.piece(delta)
            return out

        try:
            for piece in encoder.opening():
                yield piece
            try:
                for piece in pieces(parser.feed(held.advance(generation.text))):
                    yield piece
                async for event in events:
                    generation.update(event)
                    for piece in pieces(parser.feed(held.advance(generation.text))):
                        yield piece
            finally:
                await release()
            trim_stop_string(generation, self.decode)
            rest = parser.feed(held.advance(generation.text, finished=True))
            for piece in pieces(rest + parser.finish()):
                yield piece
        except Exception as exc:
            yield await self._stream_failed(stream, exc, encoder)
            return
        done = await self._finish_stream(stream, "".join(content), calls)
        for piece in encoder.closing(done):
            yield piece

    async def _finish_stream(
        self, stream: StreamState, text: str, calls: list[ToolCall]
    ) -> Completion:
        """The completion of a stream that ran to its end, recorded and handed to its
        `on_complete`; the encoder's closing events go out after this."""
        request, generation = stream.request, stream.generation
        if generation.finish is None:
            generation.finish = "stop"
        done = self._completion(
            stream.request_id, generation, text, calls, stream.prompt_ids, stream.admitted
        )
        # Stored before the last events leave: a client that sends its next request (or hangs
        # up) on the finish, before the stream's end, must find the turn pending.
        if stream.turn is not None or request.session.session_done:
            with log_context(session_id=stream.turn.session_id if stream.turn else None):
                done.headers = await self._record(
                    request,
                    stream.request_id,
                    stream.turn,
                    stream.prompt_ids,
                    generation,
                    done.message,
                    done.finish,
                    stream.admitted,
                )
        if stream.on_complete is not None:
            await stream.on_complete(done)
        return done

    async def _stream_failed(
        self, stream: StreamState, exc: Exception, encoder: StreamEncoder
    ) -> bytes:
        """The error event that ends a stream which broke after it started."""
        self._engine_failed(exc)
        await self._abandon(stream.request, stream.request_id, stream.turn)
        return encoder.failure(exc)


@dataclass
class StreamState:
    """What a started stream carries from its opening to its end."""

    request: ChatRequest
    request_id: str
    turn: TurnContext | None
    prompt_ids: list[int]
    admitted: Admission
    generation: Generation
    on_complete: Callable[[Completion], Awaitable[None]] | None = None


class StreamEncoder(Protocol):
    """One API's server-sent events for a stream; the core calls `opening` once, `piece` for
    each content delta or complete tool call, then `closing` (after recording) or, when the
    stream breaks after it started, `failure`."""

    def opening(self) -> list[bytes]: ...

    def piece(self, delta: Delta) -> list[bytes]: ...

    def closing(self, done: Completion) -> list[bytes]: ...

    def failure(self, exc: Exception) -> bytes: ...


EncoderFactory = Callable[[StreamState, "ChatService"], StreamEncoder]


def routed(payload: dict[str, Any], admitted: Admission) -> dict[str, Any]:
    """The engine request for an admitted generation: with its LoRA adapter, if any."""
    return {**payload, "lora_path": admitted.adapter} if admitted.adapter else payload


ID_PREFIXES = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


def new_request_id(api: str = "chat") -> str:
    """The response id, in the API's own form; it also keys the session scripts' writes of
    this request."""
    return ID_PREFIXES[api] + secrets.token_hex(12)
