"""A 20k-token streamed answer through the gateway completes and is recorded whole (issue 6:
cumulative stream events broke the engine client's line limit at ~14k tokens). The tiny model
is served with a context long enough for it, and streams incrementally as SGLang can."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from .conftest import MODEL, GatewayFactory
from .helpers import user

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONTEXT = 24576
ANSWER_TOKENS = 20_000


@pytest.fixture(scope="module")
def long_gateway(log_dir, redis_url, engine_factory):
    engine = engine_factory(
        MODEL, "--context-length", str(CONTEXT), "--incremental-streaming-output"
    )
    factory = GatewayFactory(log_dir, redis_url, engine)
    handle = factory.start("long-stream", CLAWRL_MODEL__CONTEXT_LENGTH=str(CONTEXT))
    yield factory.ready(handle)
    factory.stop_all()


def test_a_20k_token_streamed_answer_completes_and_is_recorded(long_gateway):
    gateway = long_gateway
    session_id = f"long-{uuid.uuid4().hex[:8]}"
    body = {
        "messages": [user("Write the longest story you can.")],
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        "stream": True,
        "logprobs": True,
    }
    content, finish, logprob_count = [], None, 0
    with httpx.stream(
        "POST",
        f"{gateway.base_url}/chat/completions",
        json=body,
        headers={"X-Session-Id": session_id, "X-Session-Done": "1"},
        timeout=httpx.Timeout(1800.0),
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            content.append(choice["delta"].get("content") or "")
            logprob_count += len((choice.get("logprobs") or {}).get("content") or [])
            finish = choice["finish_reason"] or finish
    # The random tiny model's greedy answer never reaches its end-of-turn token.
    assert finish == "length"
    assert logprob_count == ANSWER_TOKENS
    [turn] = gateway.wait_turns(session_id, 1, timeout_s=60)
    assert len(turn.response_ids) == ANSWER_TOKENS
    assert len(turn.response_logprobs) == ANSWER_TOKENS
    assert all(lp <= 0 for lp in turn.response_logprobs)
    assert "".join(content)
