"""POST /v1/outcomes' body as the gateway reads it (pure), the clear 400 each kind of bad input
gets, and X-Episode (header or body key) on a chat request marking its turn."""

from __future__ import annotations

import orjson
import pytest

from clawrl.common.episodes import Outcome
from clawrl.common.records import Turn
from clawrl.gateway.errors import InvalidRequest
from clawrl.gateway.outcomes import parse_outcome, shortened
from clawrl.gateway.protocol import session_meta
from clawrl.gateway.recording import ServedTurn, pending_turn
from clawrl.gateway.sessions import caller_scope


def parse(body: object, **headers: str):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_outcome(raw, {k.lower().replace("_", "-"): v for k, v in headers.items()}, 50)


def test_a_full_outcome() -> None:
    got = parse(
        {"session_id": "ep-1", "outcome": 1, "task_id": "sort-lines", "detail": "3/3 checks",
         "user": "runner"},
        authorization="Bearer sk-a",
    )  # fmt: skip
    assert (got.session_id, got.outcome, got.task_id, got.detail) == (
        "ep-1", 1.0, "sort-lines", "3/3 checks"
    )  # fmt: skip
    assert isinstance(got.outcome, float)
    assert got.scope == caller_scope("sk-a", "runner")  # the chat route's caller


def test_the_session_may_come_from_the_header_and_a_score_is_an_outcome() -> None:
    got = parse({"outcome": 0.25}, X_Session_Id="ep-2")
    assert (got.session_id, got.outcome, got.task_id, got.detail) == ("ep-2", 0.25, "", "")
    assert parse({"session_id": "body", "outcome": 0}, X_Session_Id="header").session_id == "body"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        ({"session_id": "s"}, "'outcome' is a required property"),
        ({"session_id": "s", "outcome": 1.5}, "outcome must be a number between 0 and 1"),
        ({"session_id": "s", "outcome": -1}, "outcome must be a number between 0 and 1"),
        ({"session_id": "s", "outcome": True}, "outcome must be a number between 0 and 1"),
        ({"session_id": "s", "outcome": "pass"}, "outcome must be a number between 0 and 1"),
        ({"outcome": 1}, "name the episode's session with 'session_id'"),
        ({"session_id": "", "outcome": 1}, "session_id"),
        ({"session_id": "s", "outcome": 1, "reward": 1}, "reward"),
        ({"session_id": "s", "outcome": 1, "task_id": 7}, "task_id"),
    ],
)
def test_bad_input_is_a_clear_400(body, message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    assert message in caught.value.message and caught.value.status == 400


def test_a_long_detail_is_cut_in_the_middle_never_refused() -> None:
    detail = "start " + "x" * 200 + " the end"
    got = parse({"session_id": "s", "outcome": 1, "task_id": "", "detail": detail})
    assert got.task_id == "" and len(got.detail) == 50
    assert got.detail.startswith("start") and got.detail.endswith("end")
    assert "[... 164 characters cut ...]" in got.detail
    assert shortened("short", 50) == "short"


def test_an_outcome_round_trips_as_stored() -> None:
    outcome = Outcome(0.5, "t", "half", at=12.5)
    assert Outcome.from_json(outcome.to_json()) == outcome
    assert outcome.content() == (0.5, "t", "half")


@pytest.mark.parametrize(
    ("headers", "body", "episode"),
    [
        ({"x-episode": "true"}, {}, True),
        ({}, {"episode": True}, True),
        ({"x-episode": "false"}, {"episode": True}, False),  # the header wins
        ({}, {}, False),
    ],
)
def test_x_episode_marks_the_request_and_the_body_key_is_stripped(
    headers: dict, body: dict, episode: bool
) -> None:
    data = {"messages": [], **body}
    assert session_meta(data, headers).episode is episode
    assert "episode" not in data  # never sent on to the engine


def test_the_recorded_turn_says_episode() -> None:
    served = ServedTurn(
        model="m", policy_version=0, admitted_policy_version=0, weight_version="0", messages=[],
        tools=None, prompt_ids=[1], response_ids=[2], response_logprobs=[-0.1], response_text="",
        response_message={"role": "assistant"}, finish_reason="stop", temperature=1.0, top_p=1.0,
        episode=True,
    )  # fmt: skip
    assert Turn.FromString(pending_turn("r1", served)).episode
