"""Sessions belong to their caller, and a client's retry is not trained beside its original:
two API keys sending one X-Session-Id have two sessions (each turn's next state its own, one
key's X-Session-Done closing only its own session, neither rating the other's turns), and a
request that repeats the pending turn's history finalises that turn as a retry's orphan."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from clawrl.common.proto.records_pb2 import FinalizeReason

from .helpers import TIMEOUT, user

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "sk-test-1", "sk-test-2"  # the `secured` gateway's two keys


def assistant(reply: httpx.Response) -> dict:
    return reply.json()["choices"][0]["message"]


def chat(gateway, key: str, session_id: str, messages: list[dict], **headers: str):
    reply = gateway.chat(
        messages, headers={"Authorization": f"Bearer {key}", "X-Session-Id": session_id, **headers}
    )
    assert reply.status_code == 200, reply.text
    return reply


def feedback(gateway, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/feedback", json=body, timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def test_two_api_keys_with_one_session_id_have_two_sessions(secured):
    gateway, sid = secured, f"main-{uuid.uuid4().hex[:8]}"
    a1 = chat(gateway, KEY_A, sid, [user("A asks")])
    b1 = chat(gateway, KEY_B, sid, [user("B asks")])
    a2 = chat(gateway, KEY_A, sid, [user("A asks"), assistant(a1), user("A follows up")])
    # B closes its session with its second turn: A's session stays open.
    b_history = [user("B asks"), assistant(b1), user("B follows up")]
    b2 = chat(gateway, KEY_B, sid, b_history, **{"X-Session-Done": "true"})
    turn_ids = [r.headers["x-turn-id"] for r in (a1, a2, b1, b2)]
    assert len(set(turn_ids)) == 4
    assert [int(t.rsplit(":", 1)[1]) for t in turn_ids] == [0, 1, 0, 1]  # each numbers its own
    turns = {t.turn_id: t for t in gateway.wait_turns(sid, 3)}
    assert set(turns) == {a1.headers["x-turn-id"], b1.headers["x-turn-id"],
                          b2.headers["x-turn-id"]}  # fmt: skip
    # Each turn's next state is its own caller's message, its history its own.
    for first, follow_up in ((a1, "A follows up"), (b1, "B follows up")):
        turn = turns[first.headers["x-turn-id"]]
        assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
        assert json.loads(turn.next_state_json) == user(follow_up)
        assert not turn.history_mismatch
    assert turns[b2.headers["x-turn-id"]].finalize_reason == (
        FinalizeReason.FINALIZE_REASON_SESSION_DONE
    )
    # A's second turn is still pending: B's X-Session-Done did not close it.
    rated = feedback(gateway, KEY_A, {"session_id": sid, "thumbs": "up"})
    assert rated.status_code == 200, rated.text
    assert rated.json()["turn_id"] == a2.headers["x-turn-id"]
    # By session and index, each caller reaches only its own turns.
    for key, mine in ((KEY_A, a1), (KEY_B, b1)):
        rated = feedback(gateway, key, {"session_id": sid, "turn_index": 0, "reward": -1})
        assert rated.status_code == 200, rated.text
        assert rated.json()["turn_id"] == mine.headers["x-turn-id"]
    # And by response id, not at all: the other caller's turn is the 404 of an unknown one.
    for key, theirs in ((KEY_A, b2), (KEY_B, a2)):
        refused = feedback(gateway, key, {"response_id": theirs.json()["id"], "reward": 1})
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "turn_not_found"
    a3 = [user("A asks"), assistant(a1), user("A follows up"), assistant(a2), user("A ends")]
    chat(gateway, KEY_A, sid, a3, **{"X-Session-Done": "true"})
    a_turns = {t.turn_id: t for t in gateway.wait_turns(sid, 5)}
    assert json.loads(a_turns[a2.headers["x-turn-id"]].next_state_json) == user("A ends")


def retried_orphans(gateway) -> float:
    return gateway.metric("clawrl_gateway_turns_finalized_total", reason="retry_orphan")


@pytest.mark.parametrize("named", [True, False], ids=["session-id", "anonymous"])
def test_a_retried_request_finalises_its_unused_original_as_an_orphan(gateway, named):
    """An SDK that timed out sends the same history again: the first reply, never seen by the
    client, is finalised RETRY_ORPHAN with no next state (not trained beside the retry's turn,
    and not given its own prompt as a next state); the retry's turn goes on as the session's."""
    tag = uuid.uuid4().hex[:8]
    headers = {"X-Session-Id": f"retry-{tag}"} if named else {}
    before = retried_orphans(gateway)
    first = gateway.chat([user(f"question {tag}")], headers=headers)
    history = [user(f"question {tag}"), first.json()["choices"][0]["message"], user("go on")]
    original = gateway.chat(history, headers=headers)
    retry = gateway.chat(history, headers=headers)
    assert first.status_code == original.status_code == retry.status_code == 200
    sid = first.headers["x-session-id"]
    assert original.headers["x-session-id"] == retry.headers["x-session-id"] == sid
    final = [*history, retry.json()["choices"][0]["message"], user("thanks")]
    gateway.chat(final, headers={**headers, "X-Session-Done": "true"})
    turns = {t.turn_id: t for t in gateway.wait_turns(sid, 4)}
    orphan = turns[original.headers["x-turn-id"]]
    assert orphan.finalize_reason == FinalizeReason.FINALIZE_REASON_RETRY_ORPHAN
    assert orphan.next_state_json == "" and not orphan.history_mismatch
    kept = turns[retry.headers["x-turn-id"]]
    assert kept.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert json.loads(kept.next_state_json) == user("thanks") and not kept.history_mismatch
    assert json.loads(turns[first.headers["x-turn-id"]].next_state_json) == user("go on")
    assert retried_orphans(gateway) == before + 1
