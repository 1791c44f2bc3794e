"""The judge against a scripted judge behind a real OpenAI-compatible API, for exact votes:
majority over real HTTP votes, every parallel tool result in the prompt, middle-shortening,
waiting out an engine outage without dead-lettering, plug-in failures, and the Judge gRPC
service."""

from __future__ import annotations

import asyncio
import itertools
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from redis.asyncio import Redis

from clawrl.common.proto import judge_pb2_grpc
from clawrl.common.proto.records_pb2 import MaskReason, Turn
from clawrl.judge.prompts import MARKER
from clawrl.judge.service import running
from tests.conftest import free_port

from .helpers import judge_settings, make_turn, pending, put_turns, said, wait_samples
from .scripted_judge import openai_backend, scripted_judge

pytestmark = pytest.mark.integration


def cycle(*texts: str):
    """An answer function giving `texts` in turn."""
    replies = itertools.cycle(texts)
    return lambda kind, prompt: next(replies)


TOOL_CALLS = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "weather", "arguments": '{"c": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
    ],
}
PARALLEL_STATE = [
    {"role": "tool", "tool_call_id": "a", "content": "RESULT-A sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "RESULT-B 10:45"},
    {"role": "user", "content": "USER-NEXT thanks"},
]


async def test_prm_majority_over_http_votes_sees_every_parallel_tool_result(
    redis: Redis, redis_url: str
) -> None:
    answers = cycle("Good. \\boxed{1}", "\\boxed{-1}", "fine \\boxed{1}")
    async with scripted_judge(answers) as judge:
        settings = judge_settings(redis_url, backend=openai_backend(judge.url))
        turn = make_turn("tools", 0, response="", next_state=PARALLEL_STATE)
        turn.response_message_json = json.dumps(TOOL_CALLS)
        legacy = make_turn("tools", 1, next_state=said("LEGACY-ONLY"), legacy_next_state=True)
        await put_turns(redis, settings, [turn, legacy])
        async with running(settings, serve=False):
            found = {s.sample_id: s for s in await wait_samples(redis, settings, 2)}
        prompts = judge.prompts("prm")
    sample = found["tools:0"]
    assert sorted(sample.votes) == [-1, 1, 1] and sample.reward == 1.0
    assert sample.reward_source == "prm" and list(sample.loss_mask) == [1.0, 1.0, 1.0]
    assert len(prompts) == 6
    first = next(p for p in prompts if "RESULT-A" in p)
    # Every tool result of the parallel calls, in order, then the user's message.
    assert first.index("RESULT-A") < first.index("RESULT-B") < first.index("USER-NEXT")
    assert "weather" in first and "clock" in first
    assert sum("LEGACY-ONLY" in p for p in prompts) == 3


async def test_ties_and_unparsable_votes_give_a_neutral_masked_sample(
    redis: Redis, redis_url: str
) -> None:
    answers = cycle("no verdict here", "\\boxed{1}", "\\boxed{-1}")
    async with scripted_judge(answers) as judge:
        settings = judge_settings(
            redis_url,
            backend=openai_backend(judge.url),
            judging={"promote_first_in_session": False},
        )
        await put_turns(redis, settings, [make_turn("tie", 0, next_state=said("hm"))])
        async with running(settings, serve=False) as service:
            (sample,) = await wait_samples(redis, settings, 1)
            invalid = service.metrics.votes.labels("prm", "invalid")._value.get()
    assert sorted(sample.votes) == [-1, 0, 1] and sample.reward == 0.0
    assert sample.mask_reason == MaskReason.MASK_REASON_NEUTRAL_SCORE
    assert set(sample.loss_mask) == {0.0} and invalid == 1


async def test_long_parts_are_shortened_in_the_middle(redis: Redis, redis_url: str) -> None:
    async with scripted_judge(cycle("\\boxed{1}")) as judge:
        settings = judge_settings(
            redis_url,
            backend=openai_backend(judge.url),
            prompt={"max_response_chars": 1000, "max_message_chars": 500},
        )
        long_reply = "BEGIN " + "x" * 50_000 + " END"
        state = [{"role": "tool", "content": "HEAD " + "y" * 20_000 + " TAIL"}]
        turn = make_turn("long", 0, response=long_reply, next_state=state)
        await put_turns(redis, settings, [turn])
        async with running(settings, serve=False) as service:
            await wait_samples(redis, settings, 1)
            shortened = service.metrics.shortened.labels("prm")._value.get()
        prompt = judge.prompts("prm")[0]
    assert shortened == 1  # one judge prompt per turn (its m votes share it)
    assert "BEGIN" in prompt and "END" in prompt and "HEAD" in prompt and "TAIL" in prompt
    assert prompt.count(MARKER.split("{n}")[0].strip()) == 2
    assert len(prompt) < 4000


async def test_an_unavailable_judge_makes_turns_wait_not_dead_letter(
    redis: Redis, redis_url: str
) -> None:
    port = free_port()
    settings = judge_settings(
        redis_url,
        backend=openai_backend(f"http://127.0.0.1:{port}/v1"),
        workers={"retry_initial_s": 0.05, "retry_max_s": 0.2, "max_deliveries": 1},
    )
    await put_turns(redis, settings, [make_turn("down", 0, next_state=said("ok"))])
    async with running(settings, serve=False) as service:
        await asyncio.sleep(1.5)
        retries = service.metrics.engine_retries._value.get()
        assert retries >= 2
        assert await redis.xlen(settings.redis.deadletter_stream) == 0
        assert await pending(redis, settings) == 1
        async with scripted_judge(cycle("\\boxed{-1}"), port=port):
            (sample,) = await wait_samples(redis, settings, 1)
    assert sample.reward == -1.0 and await pending(redis, settings) == 0


async def test_failing_reward_fns_are_dead_lettered_on_their_last_delivery(
    redis: Redis, redis_url: str
) -> None:
    reasons = {}
    for name in ("fails", "not_a_number"):
        settings = judge_settings(
            redis_url,
            judging={"reward_fn": f"tests.integration.judge.plugins:{name}"},
            workers={"max_deliveries": 1},
        )
        await put_turns(redis, settings, [make_turn(name, 0)])
        async with running(settings, serve=False):
            for _ in range(100):
                if await redis.xlen(settings.redis.deadletter_stream):
                    break
                await asyncio.sleep(0.05)
        ((_, fields),) = await redis.xrange(settings.redis.deadletter_stream)
        reasons[name] = fields[b"reason"].decode()
        assert await pending(redis, settings) == 0
    assert "plug-in bug" in reasons["fails"]
    assert "expected a finite number" in reasons["not_a_number"]


async def test_judge_grpc_scores_a_turn(redis_url: str) -> None:
    settings = judge_settings(
        redis_url, judging={"reward_fn": "tests.integration.judge.plugins:by_response"}
    )
    async with running(settings) as service:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service="clawrl.v1.Judge"))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            listed = set()
            async for reply in reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            ):
                listed |= {s.name for s in reply.list_services_response.service}
            assert "clawrl.v1.Judge" in listed and "grpc.health.v1.Health" in listed
            stub = judge_pb2_grpc.JudgeStub(channel)
            turn = make_turn("g", 0, response="-1", next_state=said("x"))
            sample = await stub.Score(turn)
            assert sample.sample_id == "g:0" and sample.reward == -1.0
            assert list(sample.response_ids) == list(turn.response_ids)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Score(Turn(turn_id="x:0", session_id="x", response_ids=[1]))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "log-probs" in error.value.details()
    # Score writes nothing to the streams.
    redis = Redis.from_url(redis_url)
    assert await redis.xlen(settings.redis.samples_stream) == 0
    await redis.aclose()
