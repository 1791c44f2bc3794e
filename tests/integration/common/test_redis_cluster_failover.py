"""Redis Cluster failover under load (issue 30): 3 primaries with a replica each
(cluster-node-timeout 1 s), the real gateway process, the real judge and the trainer's own intake.
Concurrent clients (the official `openai` client) hold conversations on every shard; the primary
of one shard is SIGKILLed mid-load, its replica takes over, and the load goes on. Then: every
request answered 2xx has its turn recorded exactly once (Turn.request_id is the response id) and
its sample reaches the trainer exactly once; a request that failed got a clean error and was
retried (counted); requests after the promotion are served, and recorded live again once the
gateway's spool has drained.

What the gateway does meanwhile (recording.py, spool.py): a record call the dead primary or the
cluster (CLUSTERDOWN while the failed node is being replaced) refuses waits in the local spool,
every later call queues behind it, and the spool is replayed when the new primary answers; a call
that ran on the old primary and was replicated before the kill is a no-op when replayed (keyed by
its request id). Not covered (docs/redis.md): a write the old primary acknowledged but had not
yet sent to its replica (replication is asynchronous); on loopback that window is the gap between
two write() calls of one event-loop pass, and this test does not try to hit it."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from clawrl.common.records import Sample, Turn, decode_entry
from clawrl.common.shards import Shards
from clawrl.judge.service import build_store, running
from clawrl.trainer.intake import Intake
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.service import make_consumer
from clawrl.trainer.settings import TrainerSettings
from tests.integration.judge.helpers import judge_settings
from tests.redis_cluster import cluster_gateway, sessions_on_every_shard, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SHARDS = 3
CLIENTS = 6  # two per shard: one streams, one does not
TURNS = 3  # main turns per conversation, the last one closes it (X-Session-Done)
PACE_S = 0.1  # a client's pause between two requests: steady load, not a flood
AFTER_PROMOTION_S = 3.0  # load kept on after the replica took over
WINDOW_S = 0.25  # bounds the asynchronous replication window (see the assertions)
BANANA = {"reward_fn": "clawrl.judge.reward_examples:ends_with_word",
          "reward_fn_args": {"word": "banana"}}  # fmt: skip


@dataclass
class Request:
    """One request a client sent, and how it ended."""

    session_id: str
    stream: bool
    started: float
    ended: float = 0.0
    response_id: str = ""  # the response's `id`: the request id its turn records
    turn_id: str = ""  # X-Turn-Id: absent when the turn was spooled, not recorded live
    error: str = ""  # the client's exception, when it got no 2xx


@dataclass
class Load:
    requests: list[Request] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def ok(self) -> list[Request]:
        return [r for r in self.requests if not r.error]

    def failed(self) -> list[Request]:
        return [r for r in self.requests if r.error]


async def ask(
    client: openai.AsyncOpenAI, history: list[dict], headers: dict, stream: bool
) -> tuple[str, str, str]:
    """One chat completion: (response id, X-Turn-Id or "", reply text)."""
    if stream:  # recorded before the finish chunk: no X-Turn-Id (headers went first)
        events = await client.chat.completions.create(
            model="m", messages=history, max_tokens=4, extra_headers=headers, stream=True
        )
        chunks = [chunk async for chunk in events]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return chunks[0].id, "", text
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=history, max_tokens=4, extra_headers=headers
    )
    completion = raw.parse()
    return completion.id, raw.headers.get("x-turn-id", ""), completion.choices[0].message.content


async def converse(
    client: openai.AsyncOpenAI, session_id: str, load: Load, stream: bool = False
) -> None:
    """One conversation of TURNS main turns; a request that fails is sent again (as a client
    would retry it) until it is answered, so every conversation is closed by its last turn."""
    history = [{"role": "user", "content": f"start {uuid.uuid4().hex}"}]
    for i in range(TURNS):
        headers = {"X-Session-Id": session_id}
        if i == TURNS - 1:
            headers["X-Session-Done"] = "true"
        while True:
            request = Request(session_id, stream, time.monotonic())
            load.requests.append(request)
            try:
                request.response_id, request.turn_id, text = await ask(
                    client, history, headers, stream
                )
            except openai.APIError as exc:
                request.error = f"{type(exc).__name__}: {exc}"
            request.ended = time.monotonic()
            await asyncio.sleep(PACE_S)
            if not request.error:
                break
        history += [{"role": "assistant", "content": text},
                    {"role": "user", "content": f"more {i}"}]  # fmt: skip


async def client_loop(url: str, shard: int, load: Load, stream: bool) -> None:
    """Conversations on sessions of one shard until the load stops, streamed or not."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
    try:
        while not load.stop.is_set():
            session_id = sessions_on_every_shard(1, SHARDS)[shard]
            await converse(client, session_id, load, stream)
    finally:
        await client.close()


async def train(url: str, trainer: TrainerSettings, trained: list[str], stop: asyncio.Event):
    """The trainer's intake, acknowledging each batch as a step commits it: `trained` gets each
    sample id handed to training. A Redis error ends a trainer process (it restarts and takes its
    pending entries back): here the intake is built again, on the ids already committed (what
    the trainer's durable state remembers) - how many times is returned."""
    committed: set[str] = set()
    restarts = 0
    redis = RedisCluster.from_url(url)
    try:
        while not stop.is_set():
            try:
                consumer = make_consumer(trainer, redis)
                await consumer.ensure_group()
                intake = Intake(consumer, TrainerMetrics(), batch_size=1, max_staleness=4,
                                vocab_size=49152, max_length=8192)  # fmt: skip
                while True:
                    batch = await intake.next_batch(0, committed.__contains__, set(), stop, 100)
                    if batch is None:
                        return restarts
                    ids = [held.sample.sample_id for held in batch.held]
                    trained.extend(ids)
                    committed.update(ids)  # the step's state is durable, then it acks
                    await consumer.ack(*[h.entry.entry_id for h in batch.held],
                                       *batch.ack_with_step)  # fmt: skip
            except (RedisError, OSError) as exc:
                restarts += 1
                print(f"trainer restarts after {type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)
        return restarts
    finally:
        await redis.aclose()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))  # fmt: skip


async def wait_for(check, timeout_s: float, what: str) -> None:
    """Until `check()` (a bool, or an awaitable of one) is true."""
    deadline = time.monotonic() + timeout_s
    while not await _value(check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s} s")
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(log_dir):
    cluster = start_cluster(log_dir, 3, "redis-failover", replicas=1, node_timeout_ms=1000)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def gateway(log_dir, cluster):
    with cluster_gateway(log_dir, cluster, SHARDS) as gateway:
        yield gateway


async def test_a_primary_killed_under_load_loses_no_turn_and_trains_none_twice(
    cluster, gateway
) -> None:
    settings = judge_settings(cluster.url, judging={"mode": "rl", **BANANA})
    redis_section = {**settings.redis.model_dump(), "turns_stream": gateway.stream,
                     "cluster": True, "stream_shards": SHARDS}  # fmt: skip
    # Turns the judge read but had not started when Redis failed (its dedupe lookup right
    # after the read), or whose read reply or XACK died with the primary, stay pending on this
    # judge: strays, taken back at its next sweep (5 s). Before, they waited for claim_idle_ms
    # (60 s, the default kept here, longer than the waits below), or forever while still held:
    # 1 run in 7-8 failed so.
    workers = {"retry_max_s": 2}
    settings = settings.with_overrides({"redis": redis_section, "workers": workers})
    trainer = TrainerSettings(
        redis=settings.redis.model_dump(), consumer={"name": "t1", "block_ms": 100}
    )
    shards = Shards(SHARDS, cluster=True)
    # Shard 0's primary: also the seed node every client was given.
    victim = cluster.primary_of(shards.name(gateway.stream, 0))
    assert cluster.url.endswith(f":{victim}/0")
    replica = cluster.replica_of(victim)

    load = Load()
    trained: list[str] = []
    training_stop = asyncio.Event()
    redis = RedisCluster.from_url(cluster.url)
    await redis.initialize()  # while its seed node is alive: it learns the others

    async def turns() -> list[Turn]:
        return [decode_entry(fields, Turn) for name in shards.names(gateway.stream)
                for _, fields in await redis.xrange(name)]  # fmt: skip

    try:
        async with running(settings, serve=False):
            trainer_task = asyncio.create_task(train(cluster.url, trainer, trained, training_stop))
            try:
                clients = [asyncio.create_task(client_loop(gateway.url, k % SHARDS, load,
                                                           stream=k >= SHARDS))
                           for k in range(CLIENTS)]  # fmt: skip
                try:
                    await wait_for(lambda: len(load.ok()) >= 30, 60, "warm-up requests")
                    killed_at = time.monotonic()
                    await asyncio.to_thread(cluster.kill, victim)
                    await asyncio.to_thread(cluster.wait_promoted, replica)
                    promoted_at = time.monotonic()
                    await asyncio.sleep(AFTER_PROMOTION_S)
                finally:
                    load.stop.set()
                    await asyncio.gather(*clients)
                # The spool drains into the new primary; then turns are recorded live again.
                await wait_for(lambda: metric(gateway.url, "clawrl_gateway_spool_entries") == 0,
                               30, "the spool drained")  # fmt: skip
                after = Load()
                async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="none") as c:
                    await converse(c, sessions_on_every_shard(1, SHARDS)[0], after)
                assert [r.error for r in after.requests] == [""] * TURNS
                assert all(r.turn_id for r in after.requests), "recorded live after the drain"
                served = {r.response_id: r for r in load.ok() + after.ok()}

                async def all_turns() -> bool:
                    return {t.request_id for t in await turns()} >= set(served)

                # A turn lost in the replication window never comes: bounded waits.
                with contextlib.suppress(AssertionError):
                    await wait_for(all_turns, 20, "every served turn recorded")
                recorded = await turns()
                turn_ids = {t.turn_id for t in recorded}
                with contextlib.suppress(AssertionError):
                    await wait_for(lambda: set(trained) >= turn_ids, 40, "every turn trained")
            finally:
                training_stop.set()
                restarts = await trainer_task
        samples = Counter()
        for k in range(SHARDS):
            stream = build_store(settings, redis, shard=k).config.samples_stream
            for _, fields in await redis.xrange(stream):
                samples[decode_entry(fields, Sample).sample_id] += 1
        extra = await make_consumer(trainer, redis).read(10, block_ms=300)
    finally:
        await redis.aclose()

    per_request = Counter(t.request_id for t in recorded)
    lost = [r for r in served.values() if r.response_id not in per_request]
    # What asynchronous replication may lose (docs/redis.md): a write the old primary had
    # answered but not yet sent to its replica when it died. Such a request started before the
    # kill, its answer came at most WINDOW_S before it, and it was recorded live (not spooled:
    # X-Turn-Id; a streamed one cannot tell). Expected empty here (loopback, microseconds).
    window = [r for r in served.values() if r.started < killed_at
              and r.ended >= killed_at - WINDOW_S and (r.turn_id or r.stream)]  # fmt: skip
    failed = load.failed()
    during = [r for r in load.requests if killed_at <= r.started < promoted_at]
    print(f"\nfailover: primary {victim} SIGKILLed, replica {replica} promoted after "
          f"{promoted_at - killed_at:.2f} s; requests {len(load.requests)} "
          f"({sum(r.stream for r in load.requests)} streamed): "
          f"{len(load.ok())} ok, {len(failed)} failed ({Counter(r.error for r in failed)}), "
          f"{len(during)} sent during the failover, "
          f"{sum(1 for r in load.ok() if r.started > promoted_at)} after it; "
          f"{sum(1 for r in load.ok() if not r.turn_id and not r.stream)} non-streamed answered "
          f"while their turn was spooled (spooled calls "
          f"{metric(gateway.url, 'clawrl_gateway_spooled_calls_total'):.0f}, replayed "
          f"{metric(gateway.url, 'clawrl_gateway_spool_replayed_calls_total'):.0f}); "
          f"turns {len(recorded)}, lost {len(lost)} ({len(window)} answered in the "
          f"{WINDOW_S} s before the kill), samples {sum(samples.values())}, "
          f"trained {len(trained)}, trainer restarts {restarts}")  # fmt: skip
    # 0 lost (outside the replication window), 0 twice, nothing recorded that was not answered.
    assert {rid for rid, n in per_request.items() if n > 1} == set()
    assert set(per_request) <= set(served), "a turn recorded for a request that failed"
    assert {r.response_id for r in lost} <= {r.response_id for r in window}, "turns lost"
    assert len(turn_ids) == len(recorded), "two turns with one id"
    # Every turn's sample exactly once in the sample streams, and trained exactly once.
    assert {sid: n for sid, n in samples.items() if n > 1} == {}
    assert set(samples) >= turn_ids
    assert len(trained) == len(set(trained)), "a sample trained twice"
    assert set(trained) >= turn_ids
    assert set(trained) - turn_ids <= {r.turn_id for r in window}
    assert extra == []
    # Failures (if any) were clean: an API error, answered, not a hang; none after promotion.
    assert all(r.ended - r.started < 20 for r in failed)
    assert [r for r in failed if r.started > promoted_at + 1] == []
    assert [r for r in load.ok() if r.started > promoted_at], "served after the promotion"
    assert during, "the load went on during the failover"


async def _value(value):
    return await value if inspect.isawaitable(value) else value
