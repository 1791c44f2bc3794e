"""Async client of SGLang's native HTTP API, used by every service that talks to an engine
(real SGLang on GPUs, or clawrl's CPU engine: both answer the same API).

aiohttp, not httpx: /generate is on the gateway's hot path, and aiohttp sends a small request in
one socket write where httpx makes two or three; on a loaded host every write that wakes the
engine costs a context switch (measured: 0.16 ms of client CPU per call against 0.58 ms). The
gateway's non-streamed /generate goes leaner still (`lean_generate`, common/http1.py: ~15 us of
client CPU a call against aiohttp's ~110 us).

Failures are two exception types, so each service maps them to its own status codes in one
place: `EngineUnavailable` (cannot connect, timed out, 5xx, garbled reply) and
`EngineRequestError` (the engine rejected the request, 4xx, with its message).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from clawrl.common.http1 import BadReply, KeepAlivePool

log = logging.getLogger(__name__)

JSON_HEADERS = {"Content-Type": "application/json"}
# Below the 5 s after which SGLang's uvicorn closes an idle keep-alive connection.
IDLE_CONNECTION_S = 3.0
UVICORN_KEEP_ALIVE_S = 5.0
# Socket reads of a stream: events of any length are reassembled from them (aiohttp's own line
# iterator refuses lines over 128 KiB, which a cumulative event passes at ~14k tokens).
STREAM_READ_BYTES = 1 << 16


class EngineError(Exception):
    """Base of the engine client's errors."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code


class EngineUnavailable(EngineError):
    """The engine could not be reached, timed out, or failed (5xx)."""


class EngineRequestError(EngineError):
    """The engine rejected the request (4xx); `message` is its explanation."""


def sampling_params(
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
    skip_special_tokens: bool = True,
) -> dict[str, Any]:
    """SGLang `sampling_params` with SGLang's field names."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "skip_special_tokens": skip_special_tokens,
    }
    if stop:
        params["stop"] = stop
    if stop_token_ids:
        params["stop_token_ids"] = stop_token_ids
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def error_message(body: bytes) -> str:
    """The engine's explanation in an error body (SGLang and OpenAI shapes)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode(errors="replace") or "no details"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if error:
            return str(error)
        if data.get("message"):
            return str(data["message"])
    return orjson.dumps(data)[:500].decode()


def raise_for_status(status: int, body: bytes, path: str) -> None:
    if status < 400:
        return
    if status >= 500:
        raise EngineUnavailable(
            f"engine answered {status} on {path}: {error_message(body)}", status_code=status
        )
    raise EngineRequestError(error_message(body), status_code=status)


class SGLangClient:
    """One engine's HTTP API over one connection pool. Create it inside a running event loop
    (a lifespan or a server's start); `await aclose()` at shutdown."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        lean_generate: bool = False,
    ):
        """`lean_generate`: non-streamed /generate calls go through http1.KeepAlivePool (a
        plain `http://` URL only), ~0.1 ms of client CPU less a call than aiohttp: for a
        serving hot path."""
        self.base_url = base_url.rstrip("/")
        self._lean: KeepAlivePool | None = None
        if lean_generate and self.base_url.startswith("http://"):
            self._lean = KeepAlivePool(
                self.base_url,
                max_connections=max_connections,
                idle_s=IDLE_CONNECTION_S,
                connect_timeout_s=connect_timeout_s,
            )
        self._timeout_s = timeout_s
        # SGLang's server (uvicorn) closes a connection idle for 5 s; a client that keeps it
        # longer can send a request on a socket the server is closing and fail with "server
        # disconnected" (seen as a 503 on the first request after an idle spell). Drop idle
        # connections first.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=max_connections, keepalive_timeout=IDLE_CONNECTION_S
            ),
        )
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        # A stream may last long; what must not last is a silence between two events.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=timeout_s
        )

    async def aclose(self) -> None:
        if self._lean is not None:
            self._lean.close()
        await self._session.close()

    async def _lean_call(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        """`_call` (POST) through the lean pool, with the same failures."""
        try:
            pool = self._lean
            assert pool is not None
            return await pool.post_json(path, orjson.dumps(payload), self._timeout_s)
        except TimeoutError as exc:
            raise EngineUnavailable(f"engine timed out on {path}") from exc
        except (OSError, BadReply) as exc:
            raise EngineUnavailable(f"engine unreachable at {self.base_url}: {exc!r}") from exc

    async def _call(
        self, method: str, path: str, payload: dict[str, Any] | None = None
    ) -> tuple[int, bytes]:
        """One request; (status, body). Transport failures become EngineUnavailable."""
        try:
            data = orjson.dumps(payload) if payload is not None else None
            async with self._session.request(
                method,
                self.base_url + path,
                data=data,
                headers=JSON_HEADERS if data is not None else None,
                timeout=self._timeout,
            ) as response:
                return response.status, await response.read()
        except TimeoutError as exc:
            raise EngineUnavailable(f"engine timed out on {path}") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"engine unreachable at {self.base_url}: {exc}") from exc
        except Exception as exc:  # anything else is a client bug: keep its cause in the log
            log.exception("engine call %s %s failed", method, path)
            raise EngineUnavailable(f"engine call {path} failed: {exc!r}") from exc

    async def _json(
        self, method: str, path: str, payload: dict[str, Any] | None = None, lean: bool = False
    ) -> Any:
        """The call's JSON reply; `lean`: a POST through the lean pool when there is one."""
        if lean and self._lean is not None and payload is not None:
            status, body = await self._lean_call(path, payload)
        else:
            status, body = await self._call(method, path, payload)
        raise_for_status(status, body, path)
        try:
            return orjson.loads(body) if body else {}
        except orjson.JSONDecodeError as exc:
            raise EngineUnavailable(f"engine answered {path} with invalid JSON", 502) from exc

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /generate (non-streaming): `{text, output_ids, meta_info}`."""
        return await self._json("POST", "/generate", {**payload, "stream": False}, lean=True)

    async def generate_stream(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST /generate with stream: yields each `data:` event until `[DONE]`. Events are
        yielded as the engine sent them (cumulative or incremental: SGLang's
        `--incremental-streaming-output`), whatever their length."""
        try:
            data = orjson.dumps({**payload, "stream": True})
            async with self._session.post(
                self.base_url + "/generate",
                data=data,
                headers=JSON_HEADERS,
                timeout=self._stream_timeout,
            ) as response:
                if response.status >= 400:
                    raise_for_status(response.status, await response.read(), "/generate")
                async for line in stream_lines(response.content):
                    if not line.startswith(b"data:"):
                        continue
                    event = line[5:].strip()
                    if event == b"[DONE]":
                        return
                    decoded = orjson.loads(event)
                    if isinstance(decoded, dict) and "error" in decoded:
                        raise EngineRequestError(error_message(event), status_code=400)
                    yield decoded
            raise EngineUnavailable("engine stream ended without [DONE]", 502)
        except EngineError:
            raise
        except TimeoutError as exc:
            raise EngineUnavailable("engine timed out while streaming /generate") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"engine stream broke: {exc}") from exc
        except orjson.JSONDecodeError as exc:
            raise EngineUnavailable("engine sent an invalid stream event", 502) from exc
        except Exception as exc:  # a client bug: keep its cause in the log
            log.exception("streaming /generate failed")
            raise EngineUnavailable(f"streaming /generate failed: {exc!r}") from exc

    async def _success_reply(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST a weight call -> `{success, message}`. A failed load is returned, not raised:
        SGLang answers it with 400 and `success: false`, and the caller reads it."""
        status, body = await self._call("POST", path, payload)
        try:
            reply = orjson.loads(body)
        except orjson.JSONDecodeError:
            reply = None
        if isinstance(reply, dict) and "success" in reply:
            return reply
        raise_for_status(status, body, path)
        raise EngineUnavailable(f"unexpected reply to {path}: {body[:200]!r}")

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        """POST /update_weights_from_disk -> `{success, message}` (see `_success_reply`)."""
        payload: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._success_reply("/update_weights_from_disk", payload)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """POST /init_weights_update_group: the engine's ranks join the trainer's broadcast
        group as rank_offset.. (GPU engines only) -> `{success, message}`."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._success_reply("/init_weights_update_group", payload)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = False,
    ) -> dict[str, Any]:
        """POST /update_weights_from_distributed: the engine receives these tensors, in this
        order, from the group's rank 0 broadcast (which must run meanwhile) -> `{success,
        message}`."""
        payload: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._success_reply("/update_weights_from_distributed", payload)

    async def begin_weight_update(self) -> dict[str, Any]:
        """POST /begin_weight_update: opens the session SGLang requires around
        /update_weights_from_distributed -> `{success, message}`."""
        return await self._success_reply("/begin_weight_update", {})

    async def end_weight_update(self) -> dict[str, Any]:
        """POST /end_weight_update: closes the session -> `{success, message}`."""
        return await self._success_reply("/end_weight_update", {})

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        """POST /destroy_weights_update_group: the engine leaves the group (closing its
        connections, which also ends a broadcast waiting on it) -> `{success, message}`."""
        return await self._success_reply(
            "/destroy_weights_update_group", {"group_name": group_name}
        )

    async def _lora_update(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST a LoRA call -> SGLang's `{success, error_message, loaded_adapters}`. A refusal
        (400 with `success: false`) raises EngineRequestError with the engine's message."""
        reply = await self._success_reply(path, payload)
        if not reply["success"]:
            # SGLang answers every refusal of a LoRA call with 400.
            raise EngineRequestError(str(reply.get("error_message") or "no details"), 400)
        return reply

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        """POST /load_lora_adapter: the engine reads the PEFT adapter directory `path` and
        serves it as `name` (a request's `lora_path`). Returns the reply; its
        `loaded_adapters` maps every loaded name to its path."""
        payload = {"lora_name": name, "lora_path": path, "pinned": pinned}
        return await self._lora_update("/load_lora_adapter", payload)

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """POST /unload_lora_adapter: new requests naming `name` are refused at once; the reply
        comes once the requests already using it have finished."""
        return await self._lora_update("/unload_lora_adapter", {"lora_name": name})

    async def lora_adapters(self) -> dict[str, str]:
        """The adapters the engine holds, name -> path, read from GET /v1/models: SGLang lists
        each adapter there as a card whose `parent` is the base model and `root` its path."""
        listing = await self._json("GET", "/v1/models")
        try:
            return {
                str(card["id"]): str(card["root"])
                for card in listing["data"]
                if card.get("parent") is not None
            }
        except (KeyError, TypeError, AttributeError) as exc:
            raise EngineUnavailable(f"unexpected reply to /v1/models: {listing!r:.200}") from exc

    async def get_model_info(self) -> dict[str, Any]:
        return await self._json("GET", "/get_model_info")

    async def health(self) -> bool:
        """GET /health: True when the engine answers 200."""
        try:
            status, _ = await self._call("GET", "/health")
        except EngineError:
            return False
        return status == 200

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._json("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._json("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._json("POST", "/flush_cache")


async def stream_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The lines of a response body (without their newline), however long each is."""
    pending = bytearray()
    async for chunk in content.iter_chunked(STREAM_READ_BYTES):
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            yield bytes(pending[start:end])
            start = end + 1
        del pending[:start]
    if pending:
        yield bytes(pending)
