"""Recording: turns become finished Turn records on the stream when the next main request of
the session arrives, with exactly what the engine sampled."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
import redis

from clawrl.common.proto.records_pb2 import FinalizeReason

from .helpers import TIMEOUT, turn_of, user

pytestmark = pytest.mark.integration


def assistant(reply: dict) -> dict:
    """The assistant message of a chat.completion body, as a client sends it back."""
    return reply["choices"][0]["message"]


def test_three_turn_session(gateway, session_id):
    headers = {"X-Session-Id": session_id}
    history = [{"role": "system", "content": "You are terse."}, user("first")]
    replies = []
    for i, text in enumerate(["second", "third"]):
        reply = gateway.chat(history, headers=headers)
        assert reply.status_code == 200
        replies.append(reply.json())
        assert reply.headers["x-turn-id"] == turn_of(session_id, replies[0]["id"], i)
        history = [*history, assistant(reply.json()), user(text)]
    first_id = turn_of(session_id, replies[0]["id"], 0)
    assert gateway.wait_turns(session_id, 1)[0].turn_id == first_id
    # The third request closes the session: it is recorded and finalised right away.
    reply = gateway.chat(history, headers={**headers, "X-Session-Done": "true"})
    assert reply.status_code == 200
    turns = gateway.wait_turns(session_id, 3)
    assert [t.turn_index for t in turns] == [0, 1, 2]
    assert [t.finalize_reason for t in turns] == [
        FinalizeReason.FINALIZE_REASON_NEXT_STATE,
        FinalizeReason.FINALIZE_REASON_NEXT_STATE,
        FinalizeReason.FINALIZE_REASON_SESSION_DONE,
    ]
    assert [json.loads(t.next_state_json)["content"] for t in turns[:2]] == ["second", "third"]
    assert turns[2].next_state_json == ""
    assert not any(t.history_mismatch for t in turns)
    first = turns[0]
    assert json.loads(first.messages_json) == history[:2]
    assert first.response_text == replies[0]["choices"][0]["message"]["content"]
    assert len(first.response_ids) == len(first.response_logprobs) == 4
    assert first.model == "smollm2-tiny" and first.gateway_id == "main"
    assert first.created_at.seconds > 0 and first.finalized_at.seconds >= first.created_at.seconds
    assert json.loads(first.response_message_json)["role"] == "assistant"


async def judge_outcomes(redis_url: str, stream: str, turns: list) -> list[str]:
    """What the judge's commit script (on the real Redis) makes of a sample of each turn:
    'published' / 'promoted', or 'duplicate' when a sample of that id was already written."""
    from redis.asyncio import Redis

    from clawrl.judge.core import Judgement, base_sample
    from clawrl.judge.store import JudgeStore, StoreConfig
    from clawrl.judge.turns import check_turn

    tag = f"test:judge-{uuid.uuid4().hex[:8]}"
    config = StoreConfig(
        prefix=tag,
        turns_stream=stream,
        samples_stream=f"{tag}:samples",
        audit_stream=f"{tag}:audit",
        group=f"{tag}:group",
        samples_maxlen=1000,
        audit_maxlen=1000,
        done_ttl_s=60,
        session_ttl_s=60,
    )
    redis = Redis.from_url(redis_url)
    try:
        store = JudgeStore(redis, config)
        entries = {
            fields[b"id"].decode(): entry_id.decode()
            for entry_id, fields in await redis.xrange(stream)
        }
        outcomes = []
        for turn in turns:  # one commit per turn, in order, as the judge's workers may
            judgement = Judgement(base_sample(check_turn(turn), "rl"), {"turn_id": turn.turn_id})
            outcomes += await store.commit([(entries[turn.turn_id], judgement)])
        return outcomes
    finally:
        await redis.aclose()


def test_a_session_id_back_after_its_state_expired_gets_new_turn_ids(
    gateway, session_id, redis_url
):
    """The session's state in Redis expires (TTL) long before the judge forgets what it judged:
    the same session id coming back starts a new state, whose turns must not reuse the ids of
    the turns before, or the judge would take them for duplicates and drop them."""
    headers = {"X-Session-Id": session_id}

    def two_turns(opening: str) -> list[httpx.Response]:
        first = gateway.chat([user(opening)], headers=headers)
        history = [user(opening), assistant(first.json()), user("and then?")]
        second = gateway.chat(history, headers={**headers, "X-Session-Done": "true"})
        assert first.status_code == second.status_code == 200
        return [first, second]

    replies = two_turns("one")
    assert len(gateway.wait_turns(session_id, 2)) == 2
    gateway.redis.delete(f"test:main:s:-:{session_id}")  # the session's state, as its TTL would
    replies += two_turns("two")
    turns = gateway.wait_turns(session_id, 4)
    ids = [t.turn_id for t in turns]
    assert [t.turn_index for t in turns] == [0, 1, 0, 1]
    assert len(set(ids)) == 4, ids
    assert ids == [r.headers["x-turn-id"] for r in replies]
    assert ids[2:] == [turn_of(session_id, replies[2].json()["id"], i) for i in (0, 1)]
    outcomes = asyncio.run(judge_outcomes(redis_url, gateway.stream, turns))
    assert outcomes == ["published"] * 4


def test_a_main_request_costs_one_redis_round_trip(gateway, session_id):
    """Finalising the session's previous turn and storing this one is one script call, seen by
    Redis MONITOR (commands run inside a script are reported as `lua`, not as round trips)."""
    headers = {"X-Session-Id": session_id}
    first = gateway.chat([user("one")], headers=headers)  # also loads the scripts
    assert first.status_code == 200
    history = [user("one"), assistant(first.json()), user("two")]
    client = redis.Redis.from_url(gateway.redis_url)
    sentinel = f"sentinel-{uuid.uuid4().hex}"
    with client.monitor() as monitor:
        reply = gateway.chat(history, headers=headers)
        assert reply.status_code == 200
        client.get(sentinel)  # the turn is stored before the response: nothing comes later
        seen = []
        while sentinel not in (command := monitor.next_command())["command"]:
            if command["client_type"] != "lua" and session_id in command["command"]:
                seen.append(command["command"].split(" ", 1)[0].upper())
    client.close()
    assert seen == ["EVALSHA"]
    assert [t.turn_id for t in gateway.wait_turns(session_id, 1)] == [
        turn_of(session_id, first.json()["id"], 0)
    ]


def test_session_keys_in_the_body_are_stripped_and_used(gateway, session_id):
    reply = gateway.chat([user("a")], session_id=session_id, session_done=True)
    assert reply.status_code == 200
    [turn] = gateway.wait_turns(session_id, 1)
    assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_SESSION_DONE


def test_side_turns_are_served_never_recorded(gateway, session_id):
    headers = {"X-Session-Id": session_id}
    assert gateway.chat([user("main")], headers=headers).status_code == 200
    side = gateway.chat([user("summarise")], headers={**headers, "X-Turn-Type": "side"})
    assert side.status_code == 200
    # A side turn with X-Session-Done closes the session without recording itself.
    done = {**headers, "X-Turn-Type": "side", "X-Session-Done": "1"}
    assert gateway.chat([user("bye")], headers=done).status_code == 200
    [turn] = gateway.wait_turns(session_id, 1)
    assert turn.turn_index == 0 and json.loads(turn.messages_json) == [user("main")]
    assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_SESSION_DONE


def test_conversation_without_session_header_is_recognised(gateway):
    client = gateway.openai()
    tag = uuid.uuid4().hex
    history = [user(f"hello {tag}")]
    for text in ("and then?", "thanks"):
        reply = client.chat.completions.create(model="m", messages=history, max_tokens=4)
        # Send the reply back the way clients do (SDK-serialised, no extra fields).
        history = [*history, reply.choices[0].message.model_dump(exclude_none=True), user(text)]
    client.chat.completions.create(
        model="m", messages=history, max_tokens=4, extra_headers={"X-Session-Done": "true"}
    )
    mine = [t for t in gateway.turns() if tag in json.loads(t.messages_json)[0]["content"]]
    assert len(mine) == 3, [t.turn_id for t in mine]
    assert len({t.session_id for t in mine}) == 1 and mine[0].session_id.startswith("anon-")
    assert [t.turn_index for t in mine] == [0, 1, 2]
    assert [json.loads(t.next_state_json)["content"] for t in mine[:2]] == ["and then?", "thanks"]
    assert not any(t.history_mismatch for t in mine)


def test_edited_history_is_marked_mismatch(gateway, session_id):
    headers = {"X-Session-Id": session_id}
    first = gateway.chat([user("original question")], headers=headers).json()
    edited = [user("EDITED question"), assistant(first), user("next")]
    assert gateway.chat(edited, headers=headers).status_code == 200
    turn = gateway.wait_turns(session_id, 1)[0]
    assert turn.history_mismatch is True
    assert json.loads(turn.next_state_json)["content"] == "next"


def test_recorded_ids_and_logprobs_are_what_the_engine_sampled(gateway, engine_url, renderer):
    session_id = f"fidelity-{uuid.uuid4().hex[:8]}"
    messages = [user("Tell me about token fidelity.")]
    reply = gateway.chat(
        messages,
        headers={"X-Session-Id": session_id, "X-Session-Done": "1"},
        max_tokens=12,
        temperature=0.5,
        top_p=0.9,
    )
    assert reply.status_code == 200
    [turn] = gateway.wait_turns(session_id, 1)
    prompt_ids, response_ids = list(turn.prompt_ids), list(turn.response_ids)
    assert prompt_ids == renderer.render_ids(messages)
    assert len(response_ids) == reply.json()["usage"]["completion_tokens"]
    teacher = httpx.post(
        f"{engine_url}/generate",
        json={
            "input_ids": prompt_ids + response_ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids),
        },
        timeout=TIMEOUT,
    ).json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in teacher] == response_ids
    assert list(turn.response_logprobs) == pytest.approx([e[0] for e in teacher], abs=2e-3)
    assert renderer.tokenizer.decode(response_ids, skip_special_tokens=True) == turn.response_text
    assert (turn.temperature, turn.top_p) == pytest.approx((0.5, 0.9))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_tool_round_trip_is_rendered_and_recorded(gateway, session_id, renderer):
    """role: tool messages and tools go into the prompt; a tool result is the next state."""
    headers = {"X-Session-Id": session_id}
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        user("Weather in Paris?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temp_c": 21}'},
    ]
    first = gateway.chat(history, headers=headers, tools=[WEATHER], tool_choice="auto")
    assert first.status_code == 200, first.text
    history += [
        assistant(first.json()),
        {"role": "tool", "tool_call_id": "call_def", "content": '{"temp_c": 22}'},
    ]
    second = gateway.chat(history, headers={**headers, "X-Session-Done": "1"}, tools=[WEATHER])
    assert second.status_code == 200
    turns = gateway.wait_turns(session_id, 2)
    assert json.loads(turns[0].tools_json) == [WEATHER]
    assert json.loads(turns[0].next_state_json)["role"] == "tool"
    assert not turns[0].history_mismatch
    prompt = renderer.tokenizer.decode(list(turns[0].prompt_ids))
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert list(turns[0].prompt_ids) == renderer.render_ids(history[:3], [WEATHER])
