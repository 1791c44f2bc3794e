"""Every failure a client can see, and the one place it becomes an HTTP status and an error
body: OpenAI's (`{"error": {"message", "type", "param", "code"}}`) on the OpenAI routes,
Anthropic's (`{"type": "error", "error": {"type", "message"}}`) on /v1/messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from clawrl.common.chat import ChatTemplateError
from clawrl.common.sglang_client import EngineRequestError, EngineUnavailable


class GatewayError(Exception):
    """A failure with its client-facing status, OpenAI error type and code."""

    status: int = 500
    type: str = "api_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    """A request body over serving.max_body_bytes."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Overloaded(GatewayError):
    """Held past the hold timeout while paused for a weight sync."""

    status = 503
    type = "overloaded_error"
    code = "gateway_paused"


class EngineDown(GatewayError):
    """The engine could not be reached or timed out."""

    status = 503
    type = "api_error"
    code = "engine_unavailable"


class AdapterUnavailable(GatewayError):
    """The engine does not have the LoRA adapter the request was routed to (an engine that
    restarted, before the launcher loads it back): retry later, never a base-model reply."""

    status = 503
    type = "api_error"
    code = "adapter_unavailable"


class EngineBadReply(GatewayError):
    """The engine failed (5xx), broke the stream, or answered something unusable."""

    status = 502
    type = "api_error"
    code = "engine_error"


class StoreUnavailable(GatewayError):
    """Redis could not be read for a stored response (previous_response_id)."""

    status = 503
    type = "api_error"
    code = "store_unavailable"


@dataclass
class HttpError:
    status: int
    body: dict
    headers: dict[str, str] = field(default_factory=dict)


def as_gateway_error(exc: BaseException, retry_after_s: int = 5) -> GatewayError:
    """Any exception as a GatewayError; unknown ones become a 500 without their details."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, ChatTemplateError):
        return InvalidRequest(str(exc), param="messages")
    if isinstance(exc, EngineUnavailable):
        if exc.status_code is None:  # connect error or timeout: nothing answered
            return EngineDown(
                f"the policy engine is unavailable: {exc.message}", retry_after_s=retry_after_s
            )
        return EngineBadReply(f"the policy engine failed: {exc.message}")
    if adapter_not_loaded(exc):
        return AdapterUnavailable(
            f"the policy engine has not loaded this version's adapter yet: {exc.message}",
            retry_after_s=retry_after_s,
        )
    if isinstance(exc, EngineRequestError):
        return InvalidRequest(f"the policy engine rejected the request: {exc.message}")
    return GatewayError("internal error in the gateway (see its logs)")


def to_http(exc: BaseException, retry_after_s: int = 5) -> HttpError:
    """The HTTP answer for a failure: status, OpenAI error body, headers."""
    error = as_gateway_error(exc, retry_after_s)
    body = {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }
    return HttpError(error.status, body, _retry_headers(error))


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
ANTHROPIC_OVERLOADED = 529


def to_anthropic(exc: BaseException, retry_after_s: int = 5) -> HttpError:
    """The HTTP answer for a failure on the Anthropic route: Anthropic's status and body (a
    gateway paused past its hold timeout is Anthropic's 529 overloaded_error)."""
    error = as_gateway_error(exc, retry_after_s)
    if isinstance(error, Overloaded):
        status, kind = ANTHROPIC_OVERLOADED, "overloaded_error"
    else:
        status, kind = error.status, ANTHROPIC_TYPES.get(error.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": error.message}}
    return HttpError(status, body, _retry_headers(error))


def _retry_headers(error: GatewayError) -> dict[str, str]:
    return {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}


def adapter_not_loaded(exc: BaseException) -> bool:
    """SGLang's refusal of a request whose lora_path names no loaded adapter: a 400 saying
    "Got LoRA adapter that has never been loaded" (a name this engine process never loaded,
    e.g. after a restart) or "The following requested LoRA adapters are not loaded"."""
    return isinstance(exc, EngineRequestError) and (
        "adapters are not loaded" in exc.message or "has never been loaded" in exc.message
    )


def engine_error_kind(exc: BaseException) -> str | None:
    """Label of an engine failure for the engine-errors metric; None when not the engine's."""
    if adapter_not_loaded(exc):
        return "adapter_not_loaded"
    if isinstance(exc, EngineUnavailable):
        return "unavailable" if exc.status_code is None else "server_error"
    if isinstance(exc, EngineRequestError):
        return "rejected"
    if isinstance(exc, EngineBadReply):
        return "bad_reply"
    return None
