"""Pure parts of recording: the whole next state, which version a turn records, and a turn's
bytes made in parts (the request's while the engine generates)."""

import time

import orjson
from google.protobuf.timestamp_pb2 import Timestamp

from clawrl.common.proto.records_pb2 import FinalizeReason
from clawrl.common.records import Turn
from clawrl.gateway.recording import (
    ServedTurn,
    finalize_extra,
    next_state_messages,
    pending_turn,
    request_fields,
)
from clawrl.gateway.versions import policy_version_of


def test_next_state_is_everything_after_the_last_reply():
    tools = [{"role": "tool", "tool_call_id": c, "content": c} for c in ("a", "b")]
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": []},
        *tools,
        {"role": "user", "content": "and?"},
    ]
    assert next_state_messages(messages) == [*tools, {"role": "user", "content": "and?"}]
    assert next_state_messages(messages[:3]) == tools[:1]


def test_without_a_reply_the_last_message_is_the_next_state():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert next_state_messages(messages) == [messages[-1]]
    ends_with_reply = [*messages, {"role": "assistant", "content": "prefill"}]
    assert next_state_messages(ends_with_reply) == [ends_with_reply[-1]]


def test_policy_version_is_the_engines_when_it_is_a_number():
    assert policy_version_of("12", 3) == 12
    assert policy_version_of("default", 3) == 3
    assert policy_version_of("", 3) == 3


SERVED = dict(
    model="m",
    policy_version=3,
    admitted_policy_version=2,
    weight_version="3",
    messages=[{"role": "user", "content": "é?"}],
    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
    prompt_ids=[5, 6, 70000],
    response_ids=[7, 8],
    response_logprobs=[-0.5, -0.25],
    response_text="ok",
    response_message={"role": "assistant", "content": "ok"},
    finish_reason="stop",
    temperature=0.7,
    top_p=0.9,
    created_ns=1_700_000_000_123_456_789,
    tenant="t",
    probe=True,
)


def whole_turn(served: ServedTurn, request_id: str) -> Turn:
    """The pending Turn as one message: what the bytes made in parts must parse to."""
    created = Timestamp()
    created.FromNanoseconds(served.created_ns)
    return Turn(
        request_id=request_id,
        model=served.model,
        policy_version=served.policy_version,
        admitted_policy_version=served.admitted_policy_version,
        weight_version=served.weight_version,
        messages_json=orjson.dumps(served.messages).decode(),
        tools_json=orjson.dumps(served.tools).decode(),
        prompt_ids=served.prompt_ids,
        response_ids=served.response_ids,
        response_logprobs=served.response_logprobs,
        response_text=served.response_text,
        response_message_json=orjson.dumps(served.response_message).decode(),
        finish_reason=served.finish_reason,
        temperature=served.temperature,
        top_p=served.top_p,
        created_at=created,
        tenant=served.tenant,
        probe=served.probe,
    )


def test_a_pending_turn_made_in_parts_is_the_whole_turn():
    served = ServedTurn(**SERVED)
    expected = whole_turn(served, "r1")
    assert Turn.FromString(pending_turn("r1", served)) == expected
    head = request_fields("r1", "m", served.messages, served.tools, served.prompt_ids)
    assert Turn.FromString(pending_turn("r1", served, head)) == expected


def test_finalisation_fields_merge_into_the_pending_turn():
    served = ServedTurn(**SERVED)
    state = [{"role": "tool", "content": "a"}, {"role": "user", "content": "b"}]
    extra = finalize_extra("g", FinalizeReason.FINALIZE_REASON_NEXT_STATE, state, True)
    turn = Turn.FromString(pending_turn("r1", served) + extra)
    assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert turn.gateway_id == "g" and turn.history_mismatch
    assert list(turn.next_state_messages_json) == [orjson.dumps(m).decode() for m in state]
    assert turn.next_state_json == orjson.dumps(state[-1]).decode()
    assert abs(turn.finalized_at.ToNanoseconds() - time.time_ns()) < 10**9
    assert turn.response_ids == served.response_ids and turn.request_id == "r1"
