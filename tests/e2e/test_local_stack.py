"""`make run`'s stack, end to end: the real processes come up, an OpenAI client talks to the
gateway, the finished turns land on the Redis stream, and a supervisor's two TERMs to its
process group stop everything (the other e2e stacks are stopped by one SIGTERM, as Ctrl-C)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import redis
from openai import OpenAI

from clawrl.common.proto.records_pb2 import MaskReason
from clawrl.common.records import Sample, Turn, decode_entry, turn_id
from clawrl.gateway.sessions import session_epoch
from tests.conftest import wait_until
from tests.e2e.local_stack import descendants, left_of, stack_process

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.fixture(scope="module")
def running(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, dict[str, int], Path]]:
    """The stack in its own process group: the module's last test stops it as a supervisor
    would (the same stack as the tests before it: a second stack would cost a minute)."""
    run_dir = tmp_path_factory.mktemp("stack")
    # Short votes: the tiny judge model's text is noise, only the mechanics are tested.
    short_votes = {"CLAWRL_BACKEND__MAX_NEW_TOKENS": "8"}
    with stack_process(
        run_dir, ("gateway", "/readyz"), env=short_votes, new_session=True, stop_timeout_s=120
    ) as (proc, ports):
        yield proc, ports, run_dir
    # Every child is gone with the stack: its ports are free again.
    for port in ports.values():
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)


@pytest.fixture(scope="module")
def stack(running) -> dict[str, int]:
    return running[1]


def test_a_session_through_the_stack_lands_on_the_turns_stream(stack: dict[str, int]) -> None:
    client = OpenAI(base_url=f"http://127.0.0.1:{stack['gateway']}/v1", api_key="local")
    headers = {"X-Session-Id": "e2e-1"}
    messages = [{"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(
        model="smollm2-tiny", messages=messages, max_tokens=6, extra_headers=headers
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Thanks!"},
    ]
    client.chat.completions.create(
        model="smollm2-tiny",
        messages=messages,
        max_tokens=6,
        extra_headers={**headers, "X-Session-Done": "true"},
    )
    r = redis.Redis(port=stack["redis"])
    entries = r.xrange("clawrl:turns")
    turns = [decode_entry(fields, Turn) for _, fields in entries]
    epoch = session_epoch(first.id)  # the session's state was made by its first request
    assert [t.turn_id for t in turns] == [turn_id("e2e-1", epoch, i) for i in (0, 1)]
    assert turns[0].next_state_json and "Thanks!" in turns[0].next_state_json
    assert turns[0].response_ids and len(turns[0].response_ids) == len(turns[0].response_logprobs)
    assert not turns[1].next_state_json  # closed by X-Session-Done


def test_the_judge_turns_the_sessions_turns_into_samples(stack: dict[str, int]) -> None:
    """Requests through the gateway end up as samples on clawrl:samples (the PRM votes of the
    tiny judge model are noise: the turn with a next state is scored, the last one masked)."""
    client = OpenAI(base_url=f"http://127.0.0.1:{stack['gateway']}/v1", api_key="local")
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(
        model="smollm2-tiny", messages=messages, max_tokens=6, extra_headers={"X-Session-Id": "j"}
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Thanks!"},
    ]
    client.chat.completions.create(
        model="smollm2-tiny",
        messages=messages,
        max_tokens=6,
        extra_headers={"X-Session-Id": "j", "X-Session-Done": "true"},
    )
    r = redis.Redis(port=stack["redis"])

    def judged() -> list[Sample]:
        found = [decode_entry(f, Sample) for _, f in r.xrange("clawrl:samples")]
        return [s for s in found if s.session_id == "j"]

    wait_until(lambda: len(judged()) == 2, 300, "samples of session j")
    samples = {s.sample_id: s for s in judged()}
    turns = {t.turn_id: t for t in (decode_entry(f, Turn) for _, f in r.xrange("clawrl:turns"))}
    ids = [turn_id("j", session_epoch(first.id), i) for i in (0, 1)]
    assert sorted(samples) == ids
    for sample_id, sample in samples.items():
        assert list(sample.response_ids) == list(turns[sample_id].response_ids)
        assert list(sample.old_logprobs) == list(turns[sample_id].response_logprobs)
    assert len(samples[ids[0]].votes) == 3 and samples[ids[0]].reward_source == "prm"
    assert samples[ids[1]].mask_reason == MaskReason.MASK_REASON_NO_NEXT_STATE
    # The judge acknowledges a turn once its sample is on the stream: just after it.
    wait_until(lambda: r.xpending("clawrl:turns", "judges")["pending"] == 0, 30, "turns acked")


def test_a_prompt_beyond_the_models_trained_context_is_served(stack: dict[str, int]) -> None:
    """make run serves a 16384-token context (smollm2-tiny, like SmolLM2, was trained on 8192):
    a ~9000-token request through the gateway is answered, a longer one than 16384 is a clear
    400, and both engines serve the same context (the judge re-reads the policy's prompts)."""
    client = OpenAI(base_url=f"http://127.0.0.1:{stack['gateway']}/v1", api_key="local")

    def notes(n: int) -> str:
        return " ".join(f"Note {i}: keep the logs." for i in range(n))  # ~10 tokens each

    reply = client.chat.completions.create(
        model="smollm2-tiny",
        messages=[{"role": "user", "content": notes(850)}],
        max_tokens=4,
        extra_headers={"X-Session-Id": "long", "X-Session-Done": "true"},
    )
    assert 8192 < reply.usage.prompt_tokens < 16384
    assert reply.usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="smollm2-tiny", messages=[{"role": "user", "content": notes(1800)}], max_tokens=4
        )
    assert refused.value.code == "context_length_exceeded"
    for port in (stack["policy"], stack["judge"]):
        info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=10).json()
        assert info["context_length"] == 16384


def _samples_of(r: redis.Redis, session_id: str) -> list[Sample]:
    found = [decode_entry(f, Sample) for _, f in r.xrange("clawrl:samples")]
    return [s for s in found if s.session_id == session_id]


def _turns_of(r: redis.Redis, session_id: str) -> list[Turn]:
    found = [decode_entry(f, Turn) for _, f in r.xrange("clawrl:turns")]
    return [t for t in found if t.session_id == session_id]


WEATHER_TOOL = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_a_responses_api_agent_with_tools_trains_through_the_stack(stack: dict[str, int]) -> None:
    """The OpenAI Responses API (official client): a tool call and its output in the input,
    then a continuation that sends only previous_response_id and the new input; both turns
    reach clawrl:turns (the first with the second's input as next state) and clawrl:samples."""
    client = OpenAI(base_url=f"http://127.0.0.1:{stack['gateway']}/v1", api_key="local")
    headers = {"X-Session-Id": "e2e-responses"}
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL}]
    first = client.responses.create(
        model="smollm2-tiny",
        instructions="Answer with the weather tool's help.",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": '{"temp_c": 24}'},
        ],
        tools=tools,
        max_output_tokens=6,
        extra_headers=headers,
    )  # fmt: skip
    second = client.responses.create(
        model="smollm2-tiny",
        instructions="Answer with the weather tool's help.",
        previous_response_id=first.id,
        input="And in Rome?",
        tools=tools,
        max_output_tokens=6,
        extra_headers={**headers, "X-Session-Done": "true"},
    )
    assert second.previous_response_id == first.id
    r = redis.Redis(port=stack["redis"])
    turns = _turns_of(r, "e2e-responses")
    assert [t.request_id for t in turns] == [first.id, second.id]
    assert json.loads(turns[0].next_state_json) == {"role": "user", "content": "And in Rome?"}
    assert not turns[0].history_mismatch
    assert json.loads(turns[1].messages_json)[2]["tool_calls"][0]["function"]["name"] == (
        "get_weather"
    )
    wait_until(lambda: len(_samples_of(r, "e2e-responses")) == 2, 300, "samples of responses")
    for sample in _samples_of(r, "e2e-responses"):
        turn = next(t for t in turns if t.turn_id == sample.sample_id)
        assert list(sample.response_ids) == list(turn.response_ids)


def test_an_anthropic_messages_agent_with_tools_trains_through_the_stack(
    stack: dict[str, int],
) -> None:
    """The Anthropic Messages API (official client, x-api-key): tool_use and tool_result blocks
    in a resent history; both turns reach clawrl:turns and clawrl:samples."""
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{stack['gateway']}", api_key="local")
    headers = {"X-Session-Id": "e2e-messages"}
    tools = [{"name": "get_weather", "input_schema": WEATHER_TOOL}]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": '{"temp_c": 24}'}]},
    ]  # fmt: skip
    first = client.messages.create(
        model="smollm2-tiny",
        system="Answer with the weather tool's help.",
        messages=history,
        tools=tools,
        max_tokens=6,
        extra_headers=headers,
    )
    history += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": "And in Rome?"},
    ]
    second = client.messages.create(
        model="smollm2-tiny",
        system="Answer with the weather tool's help.",
        messages=history,
        tools=tools,
        max_tokens=6,
        extra_headers={**headers, "X-Session-Done": "true"},
    )
    r = redis.Redis(port=stack["redis"])
    turns = _turns_of(r, "e2e-messages")
    assert [t.request_id for t in turns] == [first.id, second.id]
    assert json.loads(turns[0].next_state_json) == {"role": "user", "content": "And in Rome?"}
    assert not turns[0].history_mismatch
    wait_until(lambda: len(_samples_of(r, "e2e-messages")) == 2, 300, "samples of messages")
    for sample in _samples_of(r, "e2e-messages"):
        turn = next(t for t in turns if t.turn_id == sample.sample_id)
        assert list(sample.response_ids) == list(turn.response_ids)


def test_two_terms_to_the_group_leave_no_process_behind(running) -> None:
    """Last in this module (it stops the stack): a supervisor sends TERM to stack.py's process
    group twice, the second while the stop is under way; it exits cleanly and leaves no process
    behind, Redis, engines, gateway, judge, trainer, Ray's raylet and workers and the
    weight-sync launcher included."""
    proc, ports, run_dir = running
    stack: dict[int, tuple[int, int, int]] = {}
    try:
        # The weight-sync launcher is the last to start: then everything is up.
        url = f"http://127.0.0.1:{ports['sync-metrics']}/metrics"
        wait_until(lambda: httpx.get(url).status_code == 200, 480, url, proc)
        stack = descendants(proc.pid)
        commands = " ".join(Path(f"/proc/{pid}/cmdline").read_text() for pid in stack)
        assert "redis-server" in commands and "raylet" in commands and "ray::" in commands
        os.killpg(proc.pid, signal.SIGTERM)
        # One of its processes is gone: the stop is under way.
        wait_until(lambda: len(left_of(stack)) < len(stack), 60, "the first service's end")
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (run_dir / "stack.log").read_text()[-3000:]
        wait_until(lambda: not left_of(stack), 30, "the end of every process of the stack")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in left_of(stack) if stack else []:
            os.kill(pid, signal.SIGKILL)
