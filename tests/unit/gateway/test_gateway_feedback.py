"""POST /v1/feedback's body as the gateway reads it (pure): what a valid feedback gives, and
the clear 400 each kind of bad input gets."""

from __future__ import annotations

import orjson
import pytest

from clawrl.common.feedback import Feedback, content_id
from clawrl.gateway.errors import InvalidRequest
from clawrl.gateway.feedback import parse_feedback, request_scope
from clawrl.gateway.sessions import caller_scope


def parse(body: object, **headers: str):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_feedback(raw, {k.lower(): v for k, v in headers.items()}, 100)


def test_a_full_feedback_by_response_id() -> None:
    got = parse(
        {"response_id": "chatcmpl-1", "reward": 1, "thumbs": "up", "comment": "  Good.  ",
         "user": "u1"},
        authorization="Bearer sk-a",
    )  # fmt: skip
    assert (got.response_id, got.session_id, got.turn_index) == ("chatcmpl-1", None, None)
    assert (got.reward, got.thumbs, got.comment) == (1.0, "up", "Good.")
    assert isinstance(got.reward, float) and got.feedback_id is None
    assert got.scope == caller_scope("sk-a", "u1")  # the chat route's caller


def test_by_session_with_a_turn_and_an_idempotency_key() -> None:
    got = parse(
        {"session_id": "s1", "turn_index": 0, "thumbs": "down"}, **{"Idempotency-Key": "k-1"}
    )
    assert (got.session_id, got.turn_index, got.thumbs, got.feedback_id) == ("s1", 0, "down", "k-1")
    assert got.target() == "turn 0 of session 's1'"
    assert parse({"session_id": "s1", "reward": 0}).target() == "latest turn of session 's1'"


def test_scope_reads_bearer_or_x_api_key() -> None:
    assert request_scope({"x-api-key": "sk-b"}, None) == caller_scope("sk-b", None)
    assert request_scope({}, None) == "-"


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        (b"", {}, "the request body is empty"),
        (b"[1]", {}, "must be a JSON object"),
        (
            {"response_id": "x", "reward": 1.5},
            {},
            "reward must be a number between -1 and 1, got 1.5",
        ),
        ({"response_id": "x", "reward": True}, {}, "reward must be a number between -1 and 1"),
        ({"response_id": "x", "reward": "1"}, {}, "reward must be a number between -1 and 1"),
        ({"response_id": "x", "thumbs": "up!"}, {}, "thumbs must be 'up' or 'down'"),
        ({"response_id": "x", "comment": "   "}, {}, "give at least one of"),
        ({"response_id": "x", "comment": "x" * 101}, {}, "comment is 101 characters long"),
        ({"response_id": "", "reward": 1}, {}, "response_id must not be empty"),
        ({"session_id": "s", "turn_index": -1, "reward": 1}, {}, "turn_index"),
        ({"response_id": "x", "turn_index": 0, "reward": 1}, {}, "'turn_index' goes with"),
        ({"response_id": "x", "score": 1}, {}, "score"),
        ({"response_id": "x", "reward": 0.5, "thumbs": "down"}, {}, "contradicts reward 0.5"),
        ({"response_id": "x", "reward": 1}, {"Idempotency-Key": "a b"}, "feedback id"),
        ({"response_id": "x", "reward": 1, "feedback_id": "y" * 129}, {}, "feedback id"),
    ],
)
def test_bad_input_says_what_is_wrong(body, headers, message) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse(body, **headers)
    assert message in caught.value.message


def test_content_names_a_feedback_without_an_id() -> None:
    one = content_id("s:e:0", 1.0, None, "ok")
    assert one == content_id("s:e:0", 1.0, None, "ok")
    assert one != content_id("s:e:1", 1.0, None, "ok") != content_id("s:e:0", 1.0, None, "ok!")


def test_thumbs_are_plus_or_minus_one_and_a_reward_wins() -> None:
    assert Feedback("a", thumbs="down").explicit_reward == -1.0
    assert Feedback("a", reward=0.25, thumbs="up").explicit_reward == 0.25
    assert Feedback("a", comment="hm").explicit_reward is None
    stored = Feedback("a", reward=-0.5, comment="c", at=3.5)
    assert Feedback.from_json(stored.to_json()) == stored


def test_what_the_store_script_touches_is_in_the_shard_of_the_turns_session() -> None:
    """Redis Cluster runs a script only when its keys share a slot: the feedback hash, the
    judge's done marker and audit stream of the turn's shard (the judge's names: JudgeStore)."""
    from redis.asyncio import Redis
    from redis.crc import key_slot

    from clawrl.common.feedback import FeedbackSettings
    from clawrl.common.records import session_of
    from clawrl.common.shards import Shards
    from clawrl.gateway.feedback import FeedbackService
    from clawrl.gateway.metrics import GatewayMetrics
    from clawrl.gateway.sessions import SessionStore

    redis = Redis()  # never connected: only names are computed
    sessions = SessionStore(redis, prefix="clawrl:gw", stream="clawrl:turns", maxlen=10,
                            ttl_s=60, shards=Shards(3, cluster=True))  # fmt: skip
    service = FeedbackService(redis, sessions, FeedbackSettings(), GatewayMetrics())
    for session in ("a", "b:with:colons", "c"):
        turn = f"{session}:0123abcd:7"
        assert session_of(turn) == session
        slots = {key_slot(key.encode()) for key in service._keys(turn)}
        assert slots == {key_slot(sessions.session_key(session, "-").encode())}
