"""Stored `/v1/responses` conversations (issue 30): each response used to be stored with its whole
conversation so far, so a session of n turns cost O(n^2) bytes of Redis. A conversation is now a
thread that each response appends its own items to: what a turn stores stays the same size as
the conversation grows, on a real gateway and the CPU engine. On a real Redis, the store keeps
every conversation exact through branches and racing continuations, continues responses stored
in the earlier one-key form, and keeps the sessions' TTL."""

from __future__ import annotations

import asyncio
import json
import uuid

import orjson
import pytest
from redis.asyncio import Redis

from clawrl.gateway.conversations import ConversationStore, StoredConversation
from clawrl.gateway.metrics import GatewayMetrics

pytestmark = pytest.mark.integration

TTL_S = 600


def stored_bytes(handle) -> int:
    """The bytes of every stored response and conversation of a gateway."""
    redis, prefix, total = handle.redis, f"test:{handle.name}", 0
    for pattern in (f"{prefix}:resp:*", f"{prefix}:conv:*"):
        for key in redis.scan_iter(match=pattern, count=1000):
            if redis.type(key) == b"list":
                total += sum(len(entry) for entry in redis.lrange(key, 0, -1))
            else:
                total += redis.strlen(key)
    return total


def test_what_a_turn_stores_does_not_grow_with_the_conversation(gateway, session_id):
    client, turns, previous, added = gateway.openai(), 16, None, []
    for n in range(turns):
        before = stored_bytes(gateway)
        response = client.responses.create(
            model="m", input=f"Question {n:02d}, please.", previous_response_id=previous,
            max_output_tokens=4, temperature=0, extra_headers={"X-Session-Id": session_id},
        )  # fmt: skip
        added.append(stored_bytes(gateway) - before)
        previous = response.id
    early, late = sum(added[1:5]) / 4, sum(added[-4:]) / 4
    # The old store: each turn rewrote the whole conversation, ~90 bytes more every turn.
    assert late - early < 150, added
    assert max(added) < 1500, added
    # The conversation itself is whole: the last turn recorded was served all the questions.
    turn = gateway.wait_turns(session_id, turns - 1)[-1]
    asked = [m["content"] for m in json.loads(turn.messages_json) if m["role"] == "user"]
    assert asked == [f"Question {n:02d}, please." for n in range(turns - 1)]


@pytest.fixture
async def store(redis_url):
    redis = Redis.from_url(redis_url)
    prefix = f"test:conv-{uuid.uuid4().hex[:8]}"
    yield ConversationStore(redis, GatewayMetrics(), prefix=prefix, ttl_s=TTL_S, retry_after_s=1)
    await redis.aclose()


def said(*texts: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(texts)]  # fmt: skip


async def respond(store, parent: StoredConversation | None, *texts: str, owner="k") -> str:
    """Store a response that adds `texts` (a question and its reply) to `parent`; its id."""
    response_id = f"resp_{uuid.uuid4().hex}"
    history = parent.messages if parent is not None else []
    conversation = StoredConversation(owner, "s", [*history, *said(*texts)])
    await store.save(response_id, conversation, parent)
    return response_id


async def test_branches_and_racing_continuations_keep_each_conversation(store):
    first = await respond(store, None, "q1", "a1")
    a = await store.load(first, "k")
    second = await respond(store, a, "q2", "a2")  # the thread's newest: appended
    b = await store.load(second, "k")
    assert b.messages == said("q1", "a1", "q2", "a2") and b.thread == a.thread
    branch = await respond(store, a, "q2'", "a2'")  # a is not the newest any more
    c = await store.load(branch, "k")
    assert c.messages == said("q1", "a1", "q2'", "a2'") and c.thread != a.thread
    assert (await store.load(second, "k")).messages == b.messages  # untouched by the branch
    # Two continuations of the same response at once: one appends, the other branches.
    ids = await asyncio.gather(*(respond(store, b, f"q3-{i}", f"a3-{i}") for i in range(4)))
    for i, response_id in enumerate(ids):
        loaded = await store.load(response_id, "k")
        assert loaded.messages == [*b.messages, *said(f"q3-{i}", f"a3-{i}")]
    assert await store.load(first, "another key") is None


async def test_a_response_stored_in_the_old_form_is_continued(store):
    old_id = f"resp_{uuid.uuid4().hex}"
    old = orjson.dumps(["k", "s", said("q1", "a1")])
    await store.redis.set(store.key(old_id), old, ex=TTL_S)
    parent = await store.load(old_id, "k")
    assert parent.messages == said("q1", "a1") and parent.session_id == "s"
    assert await store.load(old_id, "another key") is None
    follow = await respond(store, parent, "q2", "a2")
    assert (await store.load(follow, "k")).messages == said("q1", "a1", "q2", "a2")


async def test_responses_and_threads_keep_the_sessions_ttl(store):
    first = await respond(store, None, "q1", "a1")
    a = await store.load(first, "k")
    thread = store.thread_key(a.thread)
    assert 0 < await store.redis.ttl(store.key(first)) <= TTL_S
    await store.redis.expire(thread, 5)
    await respond(store, a, "q2", "a2")  # an append renews the thread's TTL
    assert TTL_S - 5 < await store.redis.ttl(thread) <= TTL_S
    await store.redis.delete(thread)  # the thread gone (expired): its responses are gone too
    assert await store.load(first, "k") is None
