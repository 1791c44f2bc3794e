"""The INFO lines of a recorded turn (an ambiguous claim, a retry's orphan, a history mismatch)
are written on the event loop's next pass, after the response they belong to has gone out: the
record's metrics are counted at once, the line follows with the request's session id. Against a
real Redis."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
from redis.asyncio import Redis

from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.recording import Recorder, ServedTurn
from clawrl.gateway.sessions import SessionStore

pytestmark = pytest.mark.integration


def served(messages: list[dict]) -> ServedTurn:
    reply = {"role": "assistant", "content": " w0 w1"}
    return ServedTurn(model="m", policy_version=0, admitted_policy_version=0,
                      weight_version="0", messages=messages, tools=None, prompt_ids=[1, 2],
                      response_ids=[100, 101], response_logprobs=[-0.5, -0.25],
                      response_text=" w0 w1", response_message=reply, finish_reason="length",
                      temperature=1.0, top_p=1.0)  # fmt: skip


async def test_an_ambiguous_claim_is_counted_at_once_and_logged_after(redis_url, caplog):
    redis = Redis.from_url(redis_url, socket_timeout=None)
    prefix = f"test:notes:{random.getrandbits(32):x}"
    store = SessionStore(redis, prefix=prefix, stream=f"{prefix}:turns", maxlen=100, ttl_s=60,
                         timeout_s=5)  # fmt: skip
    metrics = GatewayMetrics()
    recorder = Recorder(store, metrics, gateway_id="g", anonymous_matching=True,
                        idle_timeout_s=60, sweep_interval_s=60, sweep_batch=10)  # fmt: skip
    messages = [{"role": "user", "content": "ping"}]
    claims = metrics.ambiguous_histories.labels("claim")
    caplog.set_level(logging.INFO, logger="clawrl.gateway.recording")
    try:
        # Two live anonymous sessions of one caller end the same history: the second claim
        # is ambiguous.
        for i in range(2):
            turn = recorder.begin(f"req-{prefix}-{i}", None, messages, messages, scope="-",
                                  done=False)  # fmt: skip
            turn_id = await recorder.finish(turn, served(messages))
            assert turn_id is not None
        assert claims._value.get() == 1
        assert not [r for r in caplog.records if "claimed by two" in r.getMessage()]
        await asyncio.sleep(0)  # the loop's next pass (the response would be out by now)
        [note] = [r for r in caplog.records if "claimed by two" in r.getMessage()]
        assert note.levelno == logging.INFO and note.session_id == turn.session_id
    finally:
        await redis.aclose()
