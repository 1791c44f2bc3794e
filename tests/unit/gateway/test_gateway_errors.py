"""The one mapping from failures to HTTP status and OpenAI error bodies."""

import pytest

from clawrl.common.chat import ChatTemplateError
from clawrl.common.sglang_client import EngineRequestError, EngineUnavailable
from clawrl.gateway.errors import ContextLengthExceeded, InvalidRequest, Overloaded, to_http


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (InvalidRequest("bad", param="messages"), 400, "invalid_request_error", None),
        (ContextLengthExceeded("long"), 400, "invalid_request_error", "context_length_exceeded"),
        (ChatTemplateError("cannot render"), 400, "invalid_request_error", None),
        (EngineUnavailable("connect refused"), 503, "api_error", "engine_unavailable"),
        (EngineUnavailable("boom", status_code=500), 502, "api_error", "engine_error"),
        (EngineRequestError("too long", status_code=400), 400, "invalid_request_error", None),
        (Overloaded("paused", retry_after_s=7), 503, "overloaded_error", "gateway_paused"),
        (RuntimeError("secret internals"), 500, "api_error", None),
    ],
)
def test_mapping(exc, status, type_, code):
    error = to_http(exc)
    assert error.status == status
    assert set(error.body["error"]) == {"message", "type", "param", "code"}
    assert error.body["error"]["type"] == type_
    assert error.body["error"]["code"] == code


def test_unknown_errors_do_not_leak_details():
    assert "secret" not in to_http(RuntimeError("secret internals")).body["error"]["message"]


def test_retry_after_header():
    assert to_http(Overloaded("paused", retry_after_s=7)).headers == {"Retry-After": "7"}
    assert to_http(EngineUnavailable("down"), retry_after_s=3).headers == {"Retry-After": "3"}
    assert to_http(InvalidRequest("bad")).headers == {}


@pytest.mark.parametrize(
    "message",
    [
        # A name the engine process never loaded (e.g. it restarted): SGLang's first check.
        "Got LoRA adapter that has never been loaded: policy-v3\nAll loaded adapters: [].",
        "The following requested LoRA adapters are not loaded: policy-v3\nLoaded adapters: [].",
    ],
)
def test_both_of_sglangs_missing_adapter_refusals_are_adapter_unavailable(message):
    error = to_http(EngineRequestError(message, status_code=400))
    assert (error.status, error.body["error"]["code"]) == (503, "adapter_unavailable")
