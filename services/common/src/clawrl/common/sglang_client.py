"""Async client of SGLang's native HTTP API, used by every service that talks to an engine
(real SGLang on GPUs, or clawrl's CPU engine: both answer the same API).

Failures are two exception types, so each service maps them to its own status codes in one
place: `EngineUnavailable` (cannot connect, timed out, 5xx) and `EngineRequestError` (the engine
rejected the request, 4xx, with its message).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


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


def _error_message(response: httpx.Response) -> str:
    """The engine's explanation from an error body (SGLang and OpenAI shapes)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if body.get("message"):
            return str(body["message"])
    return json.dumps(body)[:500]


class SGLangClient:
    """One engine's HTTP API. Create it in a lifespan, `await aclose()` at shutdown."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise EngineUnavailable(f"engine timed out on {path}") from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"engine unreachable at {self.base_url}: {exc}") from exc
        _raise_for_status(response, path)
        return response

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /generate (non-streaming): `{text, output_ids, meta_info}`."""
        response = await self._request("POST", "/generate", json={**payload, "stream": False})
        return response.json()

    async def generate_stream(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST /generate with stream: yields each `data:` event until `[DONE]`."""
        request = self._http.build_request("POST", "/generate", json={**payload, "stream": True})
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise EngineUnavailable("engine timed out on /generate") from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"engine unreachable at {self.base_url}: {exc}") from exc
        try:
            if response.status_code >= 400:
                await response.aread()
                _raise_for_status(response, "/generate")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event:
                    raise EngineRequestError(_error_message_from(event), status_code=400)
                yield event
        except httpx.TimeoutException as exc:
            raise EngineUnavailable("engine timed out while streaming /generate") from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"engine stream broke: {exc}") from exc
        finally:
            await response.aclose()

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        """POST /update_weights_from_disk -> `{success, message}` (a failed load is not raised:
        the caller reads `success`)."""
        payload: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        try:
            response = await self._http.post("/update_weights_from_disk", json=payload)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"engine unreachable at {self.base_url}: {exc}") from exc
        # SGLang answers a failed load with 400 and {success: false, message}.
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "success" in body:
            return body
        _raise_for_status(response, "/update_weights_from_disk")
        raise EngineRequestError(f"unexpected reply to /update_weights_from_disk: {body!r}")

    async def get_model_info(self) -> dict[str, Any]:
        return (await self._request("GET", "/get_model_info")).json()

    async def health(self) -> bool:
        """GET /health: True when the engine answers 200."""
        try:
            await self._request("GET", "/health")
        except EngineError:
            return False
        return True

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._request("POST", "/pause_generation", json={"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", json={})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")


def _error_message_from(event: dict[str, Any]) -> str:
    error = event.get("error")
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _raise_for_status(response: httpx.Response, path: str) -> None:
    if response.status_code < 400:
        return
    message = f"engine answered {response.status_code} on {path}: {_error_message(response)}"
    if response.status_code >= 500:
        raise EngineUnavailable(message, status_code=response.status_code)
    raise EngineRequestError(_error_message(response), status_code=response.status_code)
