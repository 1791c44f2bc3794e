"""clawrl on a real 3-primary Redis Cluster (issue 17, "Scale past one Redis"): the real gateway
(a `clawrl-gateway` process in front of the instant engine stand-in), the real judge and the
trainer's own intake, with `[redis] cluster = true` and 3 stream shards. Every served main turn
reaches the samples exactly once, the shards' keys are spread over all 3 primaries, and an
anonymous conversation is matched across shards."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster

from clawrl.common.records import Sample, decode_entry
from clawrl.common.redis_client import Script, run_script
from clawrl.judge.service import build_store, running
from clawrl.trainer.intake import Intake
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.service import make_consumer
from clawrl.trainer.settings import TrainerSettings
from tests.integration.judge.helpers import judge_settings
from tests.redis_cluster import cluster_gateway, sessions_on_every_shard, start_cluster

pytestmark = pytest.mark.integration

SHARDS = 3
BANANA = {"reward_fn": "clawrl.judge.reward_examples:ends_with_word",
          "reward_fn_args": {"word": "banana"}}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(log_dir):
    cluster = start_cluster(log_dir, primaries=3)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def gateway(log_dir, cluster):
    """(gateway url, turns stream): an instant engine and a gateway on the cluster."""
    with cluster_gateway(log_dir, cluster, SHARDS) as gateway:
        yield gateway.url, gateway.stream


def converse(url: str, turns: int, session_id: str | None) -> list[str]:
    """A conversation of `turns` main turns (the last closes it when it has an id); the turn
    ids the gateway answered with."""
    headers = {"X-Session-Id": session_id} if session_id else {}
    # An opening of its own: identical histories of one caller are ambiguous, never matched.
    history = [{"role": "user", "content": f"start {uuid.uuid4().hex}"}]
    ids = []
    for i in range(turns):
        last = i == turns - 1 and session_id is not None
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            headers={**headers, **({"X-Session-Done": "true"} if last else {})},
            json={"messages": history, "max_tokens": 4},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        ids.append(reply.headers["x-turn-id"])
        message = reply.json()["choices"][0]["message"]
        history = [*history, {"role": "assistant", "content": message["content"]},
                   {"role": "user", "content": f"more {i}"}]  # fmt: skip
    return ids


async def test_every_turn_reaches_the_samples_once_over_3_primaries(cluster, gateway) -> None:
    url, stream = gateway
    named = sessions_on_every_shard(3, SHARDS)
    turn_ids: list[str] = []
    for session_id in named:
        turn_ids += await asyncio.to_thread(converse, url, 3, session_id)
    # An anonymous conversation: its follow-ups are found by history in whichever shard holds
    # its session; its last turn is finalised by the idle sweep or stays pending (not closed).
    anonymous = await asyncio.to_thread(converse, url, 3, None)
    assert len({tid.rsplit(":", 2)[0] for tid in anonymous}) == 1, anonymous
    expected = set(turn_ids) | set(anonymous[:-1])  # the last anonymous turn is still pending

    settings = judge_settings(cluster.url, judging={"mode": "rl", **BANANA})
    redis_section = {
        **settings.redis.model_dump(),
        "turns_stream": stream,
        "cluster": True,
        "stream_shards": SHARDS,
    }
    settings = settings.with_overrides({"redis": redis_section})
    trainer = TrainerSettings(
        redis=settings.redis.model_dump(), consumer={"name": "t1", "block_ms": 100}
    )
    redis = RedisCluster.from_url(cluster.url)
    try:
        async with running(settings, serve=False):
            consumer = make_consumer(trainer, redis)
            await consumer.ensure_group()
            intake = Intake(consumer, TrainerMetrics(), batch_size=1, max_staleness=4,
                            vocab_size=49152, max_length=8192)  # fmt: skip
            trained: list[str] = []
            stop = asyncio.Event()
            async with asyncio.timeout(60):
                while len(trained) < len(expected):
                    batch = await intake.next_batch(0, lambda _: False, set(), stop, 100)
                    assert batch is not None
                    trained += [held.sample.sample_id for held in batch.held]
                    await consumer.ack(*[h.entry.entry_id for h in batch.held],
                                       *batch.ack_with_step)  # fmt: skip
            # Nothing more arrives: exactly once.
            extra = await intake.consumer.read(10, block_ms=500)
        assert extra == []
        assert sorted(trained) == sorted(expected)

        # Every shard's turns, samples and session state on its own primary, all 3 used.
        shards = settings.redis.shards()
        nodes = set()
        for k, name in enumerate(shards.names(stream)):
            node = redis.get_node_from_key(name)
            nodes.add(node.name)
            assert await redis.xlen(name) > 0, f"shard {k} got no turn"
            samples = build_store(settings, redis, shard=k).config.samples_stream
            assert redis.get_node_from_key(samples).name == node.name
            entries = await redis.xrange(samples)
            assert entries, f"shard {k} got no sample"
            for _, fields in entries:
                sample = decode_entry(fields, Sample)
                assert shards.of(sample.session_id) == k
        assert len(nodes) == 3
        for k in range(SHARDS):
            config = build_store(settings, redis, shard=k).config
            assert (await redis.xpending(config.turns_stream, "judges"))["pending"] == 0
            assert (await redis.xpending(config.samples_stream, "trainers"))["pending"] == 0
    finally:
        await redis.aclose()


async def test_many_script_calls_run_in_one_pipeline_per_node(cluster) -> None:
    """run_script on a cluster (redis-py refuses evalsha in its pipelines): results in order,
    and the calls of a node that does not know the script (first use; a restarted node) run
    once, not twice."""
    redis = RedisCluster.from_url(cluster.url)
    try:
        script = Script(redis, "return redis.call('INCR', KEYS[1])")
        tag = uuid.uuid4().hex[:6]
        keys = [f"{tag}:{{s{k % 3}}}:n{k}" for k in range(30)]
        assert await run_script(redis, script, [([key], []) for key in keys]) == [1] * 30
        # One node forgets the script (as a restarted one would): its calls run once, alone.
        node = redis.get_node_from_key(keys[0])
        await redis.execute_command("SCRIPT FLUSH", target_nodes=node)
        assert await redis.execute_command("SCRIPT EXISTS", script.sha, target_nodes=node) == [0]
        assert await run_script(redis, script, [([key], []) for key in keys]) == [2] * 30
    finally:
        await redis.aclose()


async def test_a_script_runs_on_a_node_that_does_not_know_it(cluster) -> None:
    """A node that never loaded the services' scripts (restarted; a replica promoted by a
    failover) is sent the source, once: later calls run by SHA there. The failover itself is
    test_redis_cluster_failover's (with redis-py 7's own reload, every record call after it
    failed with NOSCRIPT and the gateway's spool never drained)."""
    redis = RedisCluster.from_url(cluster.url)
    try:
        script = Script(redis, "return redis.call('INCRBY', KEYS[1], ARGV[1])")
        await redis.initialize()
        keys = [f"{uuid.uuid4().hex[:6]}:{{s{k}}}:n" for k in range(3)]  # one per node
        for node in {redis.get_node_from_key(key).name: redis.get_node_from_key(key)
                     for key in keys}.values():  # fmt: skip
            await redis.execute_command("SCRIPT FLUSH", target_nodes=node)
        assert [await script([key], [2]) for key in keys] == [2, 2, 2]
        assert [await script([key], [3]) for key in keys] == [5, 5, 5]  # by its SHA now
        for key in keys:
            node = redis.get_node_from_key(key)
            assert await redis.execute_command("SCRIPT EXISTS", script.sha,
                                               target_nodes=node) == [1]  # fmt: skip
    finally:
        await redis.aclose()


async def test_stored_responses_continue_on_a_cluster(cluster) -> None:
    """The Responses conversations (gateway/conversations.py) on a cluster: a response and its
    thread fall in different slots, and every command touches one key (issue 30)."""
    from clawrl.gateway.conversations import ConversationStore, StoredConversation
    from clawrl.gateway.metrics import GatewayMetrics

    redis = RedisCluster.from_url(cluster.url)
    store = ConversationStore(redis, GatewayMetrics(), prefix=f"t{uuid.uuid4().hex[:6]}",
                              ttl_s=60, retry_after_s=1)  # fmt: skip
    try:
        parent, messages = None, []
        for n in range(6):
            messages = [*messages, {"role": "user", "content": f"q{n}"},
                        {"role": "assistant", "content": f"a{n}"}]  # fmt: skip
            await store.save(f"resp_{n}", StoredConversation("k", "s", messages), parent)
            parent = await store.load(f"resp_{n}", "k")
            assert parent.messages == messages
        branch = StoredConversation("k", "s", [*messages[:2], {"role": "user", "content": "b"}])
        await store.save("resp_b", branch, await store.load("resp_0", "k"))
        assert (await store.load("resp_b", "k")).messages == branch.messages
        assert store.metrics.recording_failures.labels("response_store")._value.get() == 0
    finally:
        await redis.aclose()
