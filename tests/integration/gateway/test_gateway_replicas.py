"""Two real gateway processes over one Redis: idle sessions are finalised once, and a turn is
finalised exactly once when replicas race (next request vs session done vs idle sweeps)."""

from __future__ import annotations

import collections
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from clawrl.common.proto.records_pb2 import FinalizeReason

from .helpers import turn_of, user

pytestmark = pytest.mark.integration


def test_idle_timeout_finalises_the_pending_turn(idle_pair):
    a, _ = idle_pair
    session_id = f"idle-{uuid.uuid4().hex[:8]}"
    reply = a.chat([user("anyone there?")], headers={"X-Session-Id": session_id})
    assert reply.status_code == 200
    [turn] = a.wait_turns(session_id, 1, timeout_s=15)
    assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_IDLE_TIMEOUT
    assert turn.next_state_json == "" and turn.turn_id == turn_of(session_id, reply.json()["id"], 0)
    assert turn.gateway_id in ("idle-a", "idle-b")


def test_two_replicas_finalise_each_turn_exactly_once(idle_pair):
    a, b = idle_pair
    sessions = [f"race-{uuid.uuid4().hex[:8]}" for _ in range(24)]

    def first_turn(session_id):
        return a.chat([user(f"start {session_id}")], headers={"X-Session-Id": session_id}).json()

    with ThreadPoolExecutor(16) as pool:
        firsts = list(pool.map(first_turn, sessions))

    # For every session, at the same moment: the next main request on replica A, a
    # "session done" side request on replica B; meanwhile both replicas sweep for idle ones.
    def race(args):
        i, (session_id, first) = args
        history = [user(f"start {session_id}"), first["choices"][0]["message"], user("next")]
        first_replica, second_replica = (a, b) if i % 2 else (b, a)
        with ThreadPoolExecutor(2) as inner:
            main = inner.submit(first_replica.chat, history, headers={"X-Session-Id": session_id})
            done = inner.submit(
                second_replica.chat,
                [user("bye")],
                headers={"X-Session-Id": session_id, "X-Turn-Type": "side", "X-Session-Done": "1"},
            )
            assert main.result().status_code == 200 and done.result().status_code == 200

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(race, enumerate(zip(sessions, firsts, strict=True))))

    # Every turn (the first, and the second where it was served) ends up finalised, once.
    pairs = zip(sessions, firsts, strict=True)
    ids = {s: [turn_of(s, first["id"], i) for i in (0, 1)] for s, first in pairs}
    expected = {turn for pair in ids.values() for turn in pair}
    wanted = set(sessions)
    deadline = time.monotonic() + 20
    while True:
        turns = [t for t in a.turns() if t.session_id in wanted]
        if {t.turn_id for t in turns} >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    counts = collections.Counter(t.turn_id for t in turns)
    assert set(counts) == expected
    assert all(n == 1 for n in counts.values()), [k for k, n in counts.items() if n > 1]
    by_id = {t.turn_id: t for t in turns}
    for session_id in sessions:
        first = by_id[ids[session_id][0]]
        if first.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE:
            assert json.loads(first.next_state_json)["content"] == "next"
        else:
            assert first.finalize_reason in (
                FinalizeReason.FINALIZE_REASON_SESSION_DONE,
                FinalizeReason.FINALIZE_REASON_IDLE_TIMEOUT,
            )
    finalized = sum(h.metric("clawrl_gateway_turns_finalized_total") for h in (a, b))
    assert finalized >= len(expected)
