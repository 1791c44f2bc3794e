"""A stream worker: one consumer of the `judges` group on the turns stream.

Delivery: entries are read (idle ones a dead consumer left or a failure released first, then new
ones), up to `concurrency` turns are judged at once, and finished judgements are committed in
batches by one committer (store.py: sample + audit + dedupe marker + XACK, atomically per turn).
Turns in progress are re-claimed to this consumer every third of `claim_idle_ms` (XCLAIM JUSTID,
which does not count as a delivery), so a slow engine or a long outage never makes a live
worker's turns look abandoned; only a dead worker's turns are taken over. An unavailable engine
makes a turn wait with exponential backoff, never dead-letters it. A malformed turn is
dead-lettered with its reason at once; an unexpected failure leaves the turn pending for
redelivery and dead-letters it on its last allowed delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from clawrl.common.logs import log_context
from clawrl.common.records import RecordError, Turn, decode_entry, session_state_of
from clawrl.common.redis_client import REDIS_ERRORS
from clawrl.common.sglang_client import EngineUnavailable
from clawrl.common.streams import Entry, GroupConsumer, trim_acknowledged
from clawrl.judge.core import Judge, Judgement
from clawrl.judge.episodes import EpisodeWait, OutcomeWaiter
from clawrl.judge.feedback import TurnFeedback
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.settings import RetentionSettings, WorkerSettings
from clawrl.judge.store import JudgeStore
from clawrl.judge.turns import MalformedTurn, TurnView, check_turn

log = logging.getLogger(__name__)

COMMIT_BATCH = 256


class JudgeConsumer(GroupConsumer):
    """GroupConsumer whose dead-lettering is counted and audited (also the poison entries it
    dead-letters itself while claiming)."""

    def __init__(self, *args, metrics: JudgeMetrics, store: JudgeStore, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.metrics = metrics
        self.store = store

    async def dead_letter(self, entry: Entry, reason: str, category: str = "max_deliveries"):
        await super().dead_letter(entry, reason)
        self.metrics.dead_lettered.labels(category).inc()
        self.metrics.turns.labels("dead_letter").inc()
        with contextlib.suppress(*REDIS_ERRORS):
            await self.store.record_rejection(entry.record_id, reason, entry.entry_id)


@dataclass
class InFlight:
    entry: Entry
    started: float
    task: asyncio.Task | None = None
    waiting: bool = False  # an episode's turn waiting for its outcome (not being judged)


class Worker:
    def __init__(
        self,
        consumer: JudgeConsumer,
        store: JudgeStore,
        judge: Judge,
        metrics: JudgeMetrics,
        settings: WorkerSettings,
        outcomes: OutcomeWaiter | None = None,
        max_waiting: int = 0,
    ) -> None:
        self.consumer = consumer
        self.store = store
        self.judge = judge
        self.metrics = metrics
        self.settings = settings
        # None: episodes' turns are judged like chat turns (episodes off, or opd mode).
        self.outcomes = outcomes
        self.max_waiting = max_waiting  # turns waiting for outcomes beside `concurrency`
        self.waiting = 0
        self.in_flight: dict[str, InFlight] = {}
        self._room = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        self._commits: asyncio.Queue[tuple[InFlight, Judgement]] = asyncio.Queue()
        self._stopping = False

    # ----- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Judge turns until `stop` is set, then let in-flight turns finish (drain timeout)."""
        grouped = False  # the group is created in the loop: Redis may be down at start
        committer = asyncio.create_task(self._commit_forever(), name="judge-committer")
        keeper = asyncio.create_task(self._keep_claimed(), name="judge-keep-claimed")
        helpers = [committer, keeper]
        if self.outcomes is not None:
            helpers.append(asyncio.create_task(self.outcomes.run(stop), name="judge-outcomes"))
        log.info("judge worker %s reading %s", self.consumer.consumer, self.consumer.stream)
        backoff = self.settings.retry_initial_s
        try:
            while not stop.is_set():
                room = self._room_left()
                if room <= 0:
                    self._room.clear()
                    await _wait_either(self._room, stop)
                    continue
                try:
                    if not grouped:
                        await self.consumer.ensure_group()
                        grouped = True
                    await self._read_once(min(room, self.settings.read_batch))
                    backoff = self.settings.retry_initial_s
                except REDIS_ERRORS as exc:
                    log.warning("redis unavailable while reading turns: %s", exc)
                    self.metrics.errors.labels("redis").inc()
                    await _sleep_or_stop(stop, backoff)
                    backoff = min(backoff * 2, self.settings.retry_max_s)
        finally:
            self._stopping = True
            await self._drain()
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)

    def _room_left(self) -> int:
        """Turns that may be read now: `concurrency` counts the turns being judged; episodes'
        turns waiting for their outcome (no engine call) count against `max_waiting` instead."""
        judging = len(self.in_flight) - self.waiting
        total = self.settings.concurrency + self.max_waiting - len(self.in_flight)
        return min(self.settings.concurrency - judging, total)

    async def _read_once(self, count: int) -> None:
        entries = await self.consumer.read(count, self.settings.block_ms)
        try:
            await self._start(entries)
        except BaseException:
            # Read and held, never started (Redis failed in between): not lost to a hold no
            # claim ever takes over, but strays that the consumer's next sweep takes back.
            self.consumer.forget(*(e.entry_id for e in entries if e.entry_id not in self.in_flight))
            raise

    async def _start(self, entries: list[Entry]) -> None:
        """Dead-letter the malformed, acknowledge turns judged before, start judging the rest."""
        if not entries:
            return
        ready: list[tuple[Entry, TurnView]] = []
        for entry in entries:
            try:
                view = check_turn(decode_entry(entry.fields, Turn))
            except (RecordError, MalformedTurn) as exc:
                await self.consumer.dead_letter(entry, f"malformed turn: {exc}", "malformed")
                continue
            ready.append((entry, view))
        judged = await self.store.judged([view.turn.turn_id for _, view in ready])
        pairs = list(zip(ready, judged, strict=True))
        duplicates = [entry.entry_id for (entry, _), done in pairs if done]
        if duplicates:
            # Judged and committed before (the marker is written with the sample): only ack.
            await self.consumer.ack(*duplicates)
            self.metrics.turns.labels("duplicate").inc(len(duplicates))
        now = time.perf_counter()
        for (entry, view), done in pairs:
            if done:
                continue
            item = InFlight(entry, now)
            self.in_flight[entry.entry_id] = item
            self._idle.clear()
            item.task = asyncio.create_task(self._process(item, view))
        self.metrics.in_flight.set(len(self.in_flight))

    async def _process(self, item: InFlight, view: TurnView) -> None:
        turn = view.turn
        with log_context(session_id=turn.session_id, policy_version=turn.policy_version):
            try:
                episode = await self._episode(item, view)
                feedback = await self._feedback(turn.turn_id)
                judgement = await self._judge_with_retry(view, feedback, episode)
            except MalformedTurn as exc:
                self._forget(item)
                await self._reject(item.entry, str(exc), _category(exc))
                return
            except asyncio.CancelledError:
                self._forget(item)  # shutdown: stays pending, another worker takes it over
                raise
            except EngineUnavailable:
                self._forget(item)  # shutdown while waiting for the engine: stays pending
                return
            except Exception as exc:
                self._forget(item)
                self.metrics.errors.labels("judge").inc()
                if item.entry.deliveries >= self.consumer.max_deliveries:
                    await self._reject(item.entry, f"judging failed: {exc!r}", "error")
                else:
                    # Left pending: redelivered after claim_idle_ms, to this or another worker.
                    self.metrics.turns.labels("failed").inc()
                    log.warning("judging turn %s failed (delivery %d): %r", turn.turn_id,
                                item.entry.deliveries, exc)  # fmt: skip
                return
            await self._commits.put((item, judgement))

    async def _episode(self, item: InFlight, view: TurnView) -> EpisodeWait | None:
        """An episode's turn: wait for the episode's outcome (episodes.py), before its feedback
        is read (feedback given meanwhile is merged too); None for any other turn."""
        if not view.turn.episode:
            return None
        if self.outcomes is None:
            self.metrics.episode_turns.labels("unused").inc()
            return None
        item.waiting = True
        self.waiting += 1
        self._room.set()
        try:
            return await self.outcomes.wait(session_state_of(view.turn.turn_id))
        finally:
            item.waiting = False
            self.waiting -= 1

    async def _feedback(self, turn_id: str) -> TurnFeedback | None:
        """The turn's explicit feedback. Unreadable (Redis trouble): judged without it; the
        commit then audits what was stored as late, so none is lost."""
        try:
            return await self.store.feedback(turn_id)
        except REDIS_ERRORS as exc:
            self.metrics.errors.labels("feedback").inc()
            log.warning("cannot read the feedback of turn %s, judged without it: %s",
                        turn_id, exc)  # fmt: skip
            return TurnFeedback()

    async def _judge_with_retry(
        self,
        view: TurnView,
        feedback: TurnFeedback | None = None,
        episode: EpisodeWait | None = None,
    ) -> Judgement:
        delay = self.settings.retry_initial_s
        while True:
            try:
                return await self.judge.judge(view, feedback, episode)
            except EngineUnavailable as exc:
                if self._stopping:
                    raise
                self.metrics.engine_retries.inc()
                log.warning("judge engine unavailable (%s); turn %s retries in %.1fs",
                            exc, view.turn.turn_id, delay)  # fmt: skip
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, self.settings.retry_max_s)

    async def _reject(self, entry: Entry, reason: str, category: str) -> None:
        try:
            await self.consumer.dead_letter(entry, reason, category)
        except REDIS_ERRORS as exc:  # stays pending; dead-lettered again on redelivery
            log.warning("cannot dead-letter %s: %s", entry.entry_id, exc)
            self.metrics.errors.labels("redis").inc()

    def _forget(self, item: InFlight, *, committed: bool = False) -> None:
        self.in_flight.pop(item.entry.entry_id, None)
        if committed:  # the commit script acknowledged it
            self.consumer.forget(item.entry.entry_id)
        else:  # failed: pending, claimed again once idle (by this worker too), a delivery more
            self.consumer.release(item.entry.entry_id)
        self.metrics.in_flight.set(len(self.in_flight))
        self._room.set()
        if not self.in_flight:
            self._idle.set()

    # ----- committing ----------------------------------------------------------------------

    async def _commit_forever(self) -> None:
        while True:
            batch = [await self._commits.get()]
            while len(batch) < COMMIT_BATCH and not self._commits.empty():
                batch.append(self._commits.get_nowait())
            await self._commit(batch)

    async def _commit(self, batch: list[tuple[InFlight, Judgement]]) -> None:
        """Commit until Redis takes it: the script is idempotent (dedupe marker), so a retry
        after an unknown outcome never publishes twice."""
        delay = self.settings.retry_initial_s
        while True:
            try:
                outcomes = await self.store.commit(
                    [(item.entry.entry_id, judgement) for item, judgement in batch]
                )
                break
            except REDIS_ERRORS as exc:
                log.warning("redis unavailable while committing %d samples: %s", len(batch), exc)
                self.metrics.errors.labels("redis").inc()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_s)
        now = time.perf_counter()
        for (item, judgement), outcome in zip(batch, outcomes, strict=True):
            self.metrics.turns.labels(outcome).inc()
            self.metrics.turn_latency.observe(now - item.started)
            self._forget(item, committed=True)
            log.debug("turn %s: %s (%s)", judgement.sample.sample_id, outcome,
                      judgement.audit.get("mask_reason"))  # fmt: skip

    async def _drain(self) -> None:
        # Turns waiting for an outcome may wait minutes: they stay pending for the next worker.
        for item in self.in_flight.values():
            if item.waiting and item.task is not None:
                item.task.cancel()
        tasks = [item.task for item in self.in_flight.values() if item.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.settings.drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        # Finished turns leave in_flight once committed: wait for the committer.
        if self.in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5)

    # ----- keeping in-flight turns claimed -------------------------------------------------

    async def _keep_claimed(self) -> None:
        interval = self.settings.claim_idle_ms / 3000
        while True:
            await asyncio.sleep(interval)
            ids = list(self.in_flight)
            if not ids:
                continue
            try:
                await self.consumer.refresh(*ids)
            except REDIS_ERRORS as exc:
                log.warning("cannot refresh %d in-flight turns: %s", len(ids), exc)


def _category(exc: MalformedTurn) -> str:
    return "teacher" if "teacher" in str(exc) else "malformed"


async def _wait_either(event: asyncio.Event, stop: asyncio.Event) -> None:
    waits = [asyncio.create_task(event.wait()), asyncio.create_task(stop.wait())]
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def age_floor(now_s: float, keep_s: float) -> str:
    """The stream id below which entries are older than `keep_s` seconds."""
    return f"{max(0, int((now_s - keep_s) * 1000))}-0"


def _listed(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


async def housekeeping(
    redis: Redis,
    consumer: GroupConsumer | Sequence[GroupConsumer],
    streams: dict[str, str | Sequence[str]],
    metrics: JudgeMetrics,
    settings: RetentionSettings,
    stop: asyncio.Event,
    audit_stream: str | Sequence[str] | None = None,
) -> None:
    """Every `interval_s`: trim what every consumer group acknowledged from `streams`
    (`{label: stream or its shards}`), keeping the last `keep_s` seconds, trim audit records
    older than `audit_keep_s`, and refresh the lag and Redis memory gauges (lag and pending
    summed over `consumer`, one per shard)."""
    consumers = [consumer] if isinstance(consumer, GroupConsumer) else list(consumer)
    while not stop.is_set():
        try:
            now = time.time()
            floor = age_floor(now, settings.keep_s)
            for label, names in streams.items():
                for stream in _listed(names):
                    removed = await trim_acknowledged(redis, stream, keep_min_id=floor)
                    metrics.trimmed.labels(label).inc(removed)
            for audit in _listed(audit_stream):
                # Nobody consumes the audit stream as a group: age alone decides. Exact, not
                # approximate: each pass removes only what aged out since the last one.
                removed = await redis.xtrim(
                    audit, minid=age_floor(now, settings.audit_keep_s), approximate=False
                )
                metrics.trimmed.labels("audit").inc(int(removed))
            memory = await redis.info("memory")
            metrics.redis_used_memory.set(int(memory.get("used_memory", 0)))
            metrics.redis_max_memory.set(int(memory.get("maxmemory", 0)))
            lag = pending = 0
            for each in consumers:
                lag += await each.lag()
                summary = await redis.xpending(each.stream, each.group)
                pending += int(summary["pending"])
            metrics.lag.set(lag)
            metrics.pending.set(pending)
        except REDIS_ERRORS as exc:
            log.warning("housekeeping failed: %s", exc)
        await _sleep_or_stop(stop, settings.interval_s)
