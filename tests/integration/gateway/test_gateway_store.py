"""The session scripts on a real Redis: a retried write (same request id) changes nothing, and
anonymous histories are scoped to their caller and never guessed between when two live sessions
share one."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from redis.asyncio import Redis

from clawrl.common.proto.records_pb2 import FinalizeReason
from clawrl.common.records import Turn, decode_entry, turn_id
from clawrl.gateway.recording import finalize_extra
from clawrl.gateway.sessions import (
    SessionStore,
    extend_hash,
    history_hashes,
    session_epoch,
    session_member,
)

pytestmark = pytest.mark.integration

NEXT = finalize_extra("g", FinalizeReason.FINALIZE_REASON_NEXT_STATE, [{"role": "user"}])
SUPERSEDED = finalize_extra("g", FinalizeReason.FINALIZE_REASON_SUPERSEDED)
ORPHANED = finalize_extra("g", FinalizeReason.FINALIZE_REASON_RETRY_ORPHAN)
DONE = finalize_extra("g", FinalizeReason.FINALIZE_REASON_SESSION_DONE)
MISMATCH = Turn(history_mismatch=True).SerializeToString()


@pytest.fixture
async def store(redis_url):
    name = f"store-{uuid.uuid4().hex[:8]}"
    redis = Redis.from_url(redis_url)
    yield SessionStore(
        redis, prefix=f"test:{name}", stream=f"test:{name}:turns", maxlen=1000, ttl_s=60
    )
    await redis.aclose()


async def published(store: SessionStore) -> list[Turn]:
    entries = await store.redis.xrange(store.stream, "-", "+")
    return [decode_entry(fields, Turn) for _, fields in entries]


def turn_bytes(text: str) -> bytes:
    return Turn(response_text=text).SerializeToString()


def tid(first_request: str, index: int, session_id: str = "s") -> str:
    """The id of a turn of the session state that request `first_request` made."""
    return turn_id(session_id, session_epoch(first_request), index)


async def record(store, request_id, session_id=None, *, scope="-", prefixes=("h",), **turn):
    return await store.record(
        request_id,
        session_id,
        scope=scope,
        arrived=time.time(),
        prefixes=list(prefixes),
        next_state=NEXT,
        mismatch=MISMATCH,
        superseded=SUPERSEDED,
        new_session_id=f"anon-{uuid.uuid4().hex}",
        **{"orphaned": ORPHANED, **turn},
    )


async def store_turn(store, request_id, session_id, text="r", history="h", done=b""):
    return await record(
        store, request_id, session_id, turn=turn_bytes(text), history_hash=history, done=done
    )


async def advance(store, request_id, session_id=None, scope="-", prefixes=("h",)):
    """A request that stores no turn (it failed): it only finalises the pending one."""
    return await record(store, request_id, session_id, scope=scope, prefixes=prefixes)


async def test_a_retried_store_records_one_turn(store):
    first = await store_turn(store, "req-1", "s", done=DONE)
    again = await store_turn(store, "req-1", "s", done=DONE)
    assert first == again and first.turn_id == tid("req-1", 0)
    turns = await published(store)
    assert [t.turn_id for t in turns] == [tid("req-1", 0)]
    # A new request id is a new turn (of the same state: closing it kept its counter).
    assert (await store_turn(store, "req-2", "s")).turn_id == tid("req-1", 1)


async def test_a_session_whose_state_expired_gets_new_turn_ids(store):
    """The session's state gone (its TTL ran out), the same session id starts again at index 0,
    under the epoch of the request that made the new state: no id repeats an earlier turn's."""
    await store_turn(store, "req-0", "s")
    await store_turn(store, "req-1", "s", done=DONE)
    await store.redis.delete(store.session_key("s", "-"))  # as its TTL would
    await store_turn(store, "req-2", "s")
    await store_turn(store, "req-3", "s", done=DONE)
    ids = [t.turn_id for t in await published(store)]
    assert ids == [tid("req-0", 0), tid("req-0", 1), tid("req-2", 0), tid("req-2", 1)]
    assert len(set(ids)) == 4


async def test_a_retried_pending_store_does_not_supersede_itself(store):
    first = await store_turn(store, "req-1", "s")
    again = await store_turn(store, "req-1", "s")
    assert again == first and first.superseded_turn_id is None
    assert await published(store) == []
    assert await store.redis.hget(store.session_key("s", "-"), "next") == b"1"


async def test_a_retried_advance_does_not_finalise_a_later_turn(store):
    """A late retry of request 1's advance must not hand request 1's next state to the turn
    request 2 stored in between."""
    await store_turn(store, "req-0", "s")
    first = await advance(store, "req-1", "s")
    assert first.finalized_turn_id == tid("req-0", 0)
    await store_turn(store, "req-2", "s", history="h2")
    again = await advance(store, "req-1", "s", prefixes=("h2",))
    assert again == first
    assert [t.turn_id for t in await published(store)] == [tid("req-0", 0)]
    assert await store.redis.hget(store.session_key("s", "-"), "tid") == tid("req-0", 1).encode()


async def test_a_retried_finalize_publishes_once(store):
    await store_turn(store, "req-0", "s")
    assert await store.finalize("req-1", session_member("-", "s"), DONE) == tid("req-0", 0)
    await store_turn(store, "req-2", "s")
    assert await store.finalize("req-1", session_member("-", "s"), DONE) == tid("req-0", 0)
    assert [t.turn_id for t in await published(store)] == [tid("req-0", 0)]


async def test_anonymous_histories_are_scoped_to_the_caller(store):
    hashes = history_hashes([{"role": "user", "content": "hi"}])
    reply = {"role": "assistant", "content": "hello"}
    history = extend_hash(hashes[-1], reply)
    for scope, request_id in (("alice", "a-0"), ("bob", "b-0")):
        await record(
            store,
            request_id,
            scope=scope,
            prefixes=(),
            turn=turn_bytes(scope),
            history_hash=history,
        )
    alice = await advance(store, "a-1", scope="alice", prefixes=(history,))
    bob = await advance(store, "b-1", scope="bob", prefixes=(history,))
    stranger = await advance(store, "c-1", scope="carol", prefixes=(history,))
    assert alice.finalized_turn_id and bob.finalized_turn_id
    assert alice.session_id != bob.session_id
    assert stranger.finalized_turn_id is None and not stranger.ambiguous
    turns = await published(store)
    texts = {t.turn_id: t.response_text for t in turns}
    assert texts == {tid("a-0", 0, alice.session_id): "alice", tid("b-0", 0, bob.session_id): "bob"}
    # The session id in the record is the one the script resolved.
    assert {t.session_id for t in turns} == {alice.session_id, bob.session_id}


async def test_two_live_sessions_of_one_caller_on_one_history_are_not_guessed(store):
    for session_id in ("s1", "s2"):
        stored = await record(
            store,
            f"req-{session_id}",
            session_id,
            scope="me",
            turn=turn_bytes(session_id),
            history_hash="same",
        )
    assert stored.claim_ambiguous  # the second claim
    follow_up = await advance(store, "req-3", scope="me", prefixes=("same",))
    assert follow_up.ambiguous and follow_up.session_id.startswith("anon-")
    assert follow_up.finalized_turn_id is None
    assert await published(store) == []
    # Sequential sessions with one opening are not ambiguous: the first one moved on.
    await store_turn(store, "req-6", "t1", history="opening")
    await store.finalize("req-7", session_member("-", "t1"), DONE)
    second = await store_turn(store, "req-8", "t2", text="t2", history="opening")
    assert not second.claim_ambiguous
    assert (await advance(store, "req-9", prefixes=("opening",))).session_id == "t2"


async def test_next_state_holds_every_message_after_the_reply(store):
    await store_turn(store, "req-0", "s")
    messages = [
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "user", "content": "thanks"},
    ]
    await store.record(
        "req-1",
        "s",
        scope="-",
        arrived=time.time(),
        prefixes=["h"],
        next_state=finalize_extra("g", FinalizeReason.FINALIZE_REASON_NEXT_STATE, messages),
        mismatch=MISMATCH,
        superseded=SUPERSEDED,
        new_session_id="unused",
    )
    [turn] = await published(store)
    assert [json.loads(m) for m in turn.next_state_messages_json] == messages
    assert json.loads(turn.next_state_json) == messages[-1]


async def test_a_turn_stored_after_a_request_arrived_is_superseded_not_answered(store):
    """Two requests of one session in flight at once: the later-finishing one is not the next
    state of its sibling's turn (stored while it was generating); that turn is superseded."""
    arrived = time.time()
    await store_turn(store, "req-0", "s")  # the sibling finished first
    late = await store.record(
        "req-1",
        "s",
        scope="-",
        arrived=arrived,
        prefixes=["h"],
        next_state=NEXT,
        mismatch=MISMATCH,
        superseded=SUPERSEDED,
        new_session_id="unused",
        turn=turn_bytes("late"),
        history_hash="h1",
    )
    assert late.superseded_turn_id == tid("req-0", 0) and late.finalized_turn_id is None
    assert late.turn_id == tid("req-0", 1)
    [turn] = await published(store)
    assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_SUPERSEDED
    assert not turn.next_state_json


async def test_a_failed_request_still_answers_and_closes_its_session(store):
    await store_turn(store, "req-0", "s")
    failed = await record(store, "req-1", "s", done=DONE)
    assert failed.finalized_turn_id == tid("req-0", 0) and failed.turn_id is None
    [turn] = await published(store)
    assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert await store.redis.zscore(store.active_key, "s") is None


async def test_one_session_id_names_a_session_of_each_caller(store):
    """Two callers sending the same session id have two sessions: the second's request neither
    finalises the first's pending turn nor closes it, and each numbers its own turns."""
    alice, bob = "a" * 24, "b" * 24
    await record(store, "a-0", "main", scope=alice, turn=turn_bytes("alice"), history_hash="ha")
    bob_first = await record(
        store, "b-0", "main", scope=bob, turn=turn_bytes("bob"), history_hash="hb", done=DONE
    )
    assert bob_first.finalized_turn_id is None and bob_first.turn_id == tid("b-0", 0, "main")
    assert await store.finalize("b-1", session_member(bob, "main"), DONE) is None
    assert [t.response_text for t in await published(store)] == ["bob"]  # done at once
    alice_next = await advance(store, "a-1", "main", scope=alice, prefixes=("ha",))
    assert alice_next.finalized_turn_id == tid("a-0", 0, "main")
    assert not alice_next.history_mismatch
    assert [t.response_text for t in await published(store)] == ["bob", "alice"]


async def test_a_retry_of_the_pending_request_finalises_it_as_an_orphan(store):
    """A request with the pending turn's own history is its client retrying it: the pending
    turn is finalised as RETRY_ORPHAN (no next state, no mismatch), the retry's turn is pending.
    A call spooled by an older gateway (no orphaned extra) finalises it as superseded."""
    await store_turn(store, "req-0", "s")
    retried = dict(turn=turn_bytes("first"), history_hash="h1", request_hash="q1")
    await record(store, "req-1", "s", **retried)
    again = await record(store, "req-2", "s", **{**retried, "turn": turn_bytes("retry")})
    assert again.orphaned_turn_id == tid("req-0", 1) and again.finalized_turn_id is None
    assert not again.history_mismatch and again.turn_id == tid("req-0", 2)
    turns = {t.response_text: t for t in await published(store)}
    assert set(turns) == {"r", "first"}
    orphan = turns["first"]
    assert orphan.finalize_reason == FinalizeReason.FINALIZE_REASON_RETRY_ORPHAN
    assert not orphan.next_state_json and not orphan.history_mismatch
    # The retry's own turn is the pending one: the next request extends it as usual.
    follow = await advance(store, "req-3", "s", prefixes=("h1",))
    assert follow.finalized_turn_id == tid("req-0", 2) and not follow.history_mismatch
    await record(store, "req-4", "s", **retried)
    old = await record(store, "req-5", "s", **retried, orphaned=b"")
    assert old.orphaned_turn_id == tid("req-0", 3)
    assert (await published(store))[-1].finalize_reason == (
        FinalizeReason.FINALIZE_REASON_SUPERSEDED
    )


async def test_a_session_left_by_an_older_gateway_is_still_swept(store):
    """Before sessions were per caller, a session's state and active-set member were keyed by
    the bare session id: the idle sweep's finalize still publishes the turn it left pending."""
    shard_prefix = store.prefixes[0]
    stored = Turn(turn_id="old:e:0", session_id="old", response_text="old").SerializeToString()
    await store.redis.hset(f"{shard_prefix}:s:old", mapping={"turn": stored, "tid": "old:e:0"})
    await store.redis.zadd(store.active_key, {"old": 1.0})
    assert await store.finalize("sweep-1", "old", DONE, idle_cutoff=2.0) == "old:e:0"
    assert [t.turn_id for t in await published(store)] == ["old:e:0"]
    assert await store.redis.zcard(store.active_key) == 0
