"""Fills a step's batch from `clawrl:samples` (consumer group `trainers`).

Delivery is at-least-once, so every entry ends in exactly one of these ways:
- trainable: held, trained, and acknowledged only once a durable state includes its step;
- masked (a mask reason / no trained token): acknowledged now, it never fills a batch;
- stale (older than max_staleness policy versions): acknowledged now, counted;
- per tenant, served by an adapter since reset or removed, or of a tenant no longer selected
  (tenants.route): acknowledged now, counted (tenant_reset, tenant_unrouted);
- a sample id already trained (in a durable state): acknowledged now, counted;
- a sample id trained in a step that is not durable yet (or twice in this batch): acknowledged
  together with that step's entries;
- malformed: dead-lettered with the reason (which acknowledges it), counted;
- a poison sample (the backend was lost on every step that held it, the last with it alone):
  dead-lettered with the reason, counted.
Entries read but not yet part of a step (the trainer stopping mid-batch) stay pending and come
back after a restart: first this consumer's own pending entries are read again. Redis failing
while a batch is filled (a failover, a cluster rebuilding its slot map) loses nothing either:
what the call had read goes back in front of the backlog and the trainer reads again after a
pause (`Trainer.run`), without a restart.

A batch that kills the backend (a host OOM: `BackendLost`) also comes back after the restart. So
that it cannot do so forever, every step counts in Redis, per entry, the steps started with it
that never finished (`UnfinishedSteps`): while an entry's count is at most `loss_retries` its
batch is retried whole; after that each further loss halves the steps it may be in, until the
sample that kills the backend is alone in its step and, losing it once more, is dead-lettered.
The rest of its batch is trained in the smaller steps.

In `[tenants] mode = "per_tenant"` admitted samples wait in their adapter's queue
(`tenants.TenantQueues`) and a batch is one adapter's, in the queues' fair order; samples of
other adapters keep waiting, pending, for their own steps (after a restart they are read again).
There a batch that lost the backend is retried whole (no halving) until its entries' counts
would have put each alone in a step; then they are dead-lettered as they come back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeAlias

from redis.asyncio import Redis

from clawrl.common.records import RecordError, Sample, decode_entry
from clawrl.common.redis_client import REDIS_ERRORS
from clawrl.common.streams import Entry, GroupConsumer
from clawrl.common.tenants import SHARED, TenantSettings
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.samples import BadSample, ModeMismatch, check_mode, check_sample, is_trainable
from clawrl.trainer.tenants import TenantQueues, Unroutable

log = logging.getLogger(__name__)


def step_limit(losses: int, batch_size: int, retries: int) -> int:
    """The most samples a step may hold beside a sample whose steps lost the backend `losses`
    times: the whole batch while `losses <= retries` (a transient host OOM), then half as many
    (rounded up) for each further loss down to 1, and 0 (dead-letter it) once it lost the backend
    alone."""
    size = batch_size
    for _ in range(losses - retries):
        size = 0 if size <= 1 else (size + 1) // 2
    return size


class UnfinishedSteps:
    """Per stream entry, the training steps started with it that never finished: a Redis hash
    (entry id -> count), durable across a trainer's restart. A step counts its entries before
    the backend sees them and forgets them when it is done (trained or rejected), so what is
    left counts steps the backend (or the whole trainer) died in."""

    def __init__(self, redis: Redis, key: str) -> None:
        self.redis = redis
        self.key = key

    async def begin(self, entry_ids: list[str]) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for entry_id in entry_ids:
                pipe.hincrby(self.key, entry_id, 1)
            await pipe.execute()

    async def finish(self, entry_ids: list[str]) -> None:
        if entry_ids:
            await self.redis.hdel(self.key, *entry_ids)

    async def counts(self, entry_ids: list[str]) -> dict[str, int]:
        """The count of each entry that has one."""
        if not entry_ids:
            return {}
        values = await self.redis.hmget(self.key, entry_ids)
        return {eid: int(v) for eid, v in zip(entry_ids, values, strict=True) if v is not None}


@dataclass
class Held:
    """A trainable sample and the stream entry it came in."""

    sample: Sample
    entry: Entry

    @property
    def xadd_time_s(self) -> float:
        """When the entry was added (its id's millisecond part)."""
        return self.entry.added_s


@dataclass
class Collected:
    """A full batch of trainable samples, and entries to acknowledge with its step."""

    held: list[Held] = field(default_factory=list)
    ack_with_step: list[str] = field(default_factory=list)
    tenant: str = SHARED  # the adapter the batch trains (per-tenant mode)


# The policy version samples are measured against: one for all, or per sample (per-tenant mode:
# the version of the adapter the sample trains).
CurrentVersion: TypeAlias = int | Callable[[Sample], int]
# Intake._admit with the batch's versions and trained ids bound: (entry, in_batch=, lost=).
Admit: TypeAlias = Callable[..., Awaitable["Sample | str | None"]]


class Intake:
    def __init__(
        self,
        consumer: GroupConsumer,
        metrics: TrainerMetrics,
        *,
        batch_size: int,
        max_staleness: int,
        vocab_size: int,
        max_length: int,
        loss_retries: int = 1,
        estimator: str = "grpo",
        tenants: TenantSettings | None = None,
    ) -> None:
        self.consumer = consumer
        self.metrics = metrics
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.estimator = estimator
        self.loss_retries = loss_retries
        self.unfinished = UnfinishedSteps(
            consumer.redis, f"{consumer.stream}:{consumer.group}:unfinished-steps"
        )
        # Own pending entries (read once at start), then entries read that did not fit a step.
        self._backlog: list[Entry] | None = None
        # Of a call that Redis failed: entries to acknowledge with the next batch's step.
        self._carried_acks: list[str] = []
        self._unread: list[Entry] = []  # read by this call, not dealt with yet
        self.queues: TenantQueues[Held] | None = None
        if tenants is not None and tenants.per_tenant:
            self.queues = TenantQueues(tenants, batch_size)

    async def next_batch(
        self,
        policy_version: CurrentVersion,
        trained: Callable[[str], bool],
        uncommitted: set[str],
        stop: asyncio.Event,
        block_ms: int = 1000,
        between_reads: Callable[[], Awaitable[None]] | None = None,
    ) -> Collected | None:
        """A batch of `batch_size` trainable samples (fewer beside a sample a step lost the
        backend with), or None when `stop` is set first (what was read then stays pending).
        `trained(id)`: the id is in a durable state; `uncommitted`: ids trained in steps not
        durable yet. Per tenant, `between_reads` runs before each look for a ready batch (the
        trainer's resets: before the next step, and a quiet stream must not hold them back)."""
        if self._backlog is None:
            self._backlog = await self.consumer.read_own_pending(count=100_000)
            if self._backlog:
                log.info("taking back %d pending entries of a previous run", len(self._backlog))
        collected = Collected(ack_with_step=self._carried_acks)
        self._carried_acks, self._unread = [], []
        admit = functools.partial(
            self._admit, policy_version=policy_version, trained=trained, uncommitted=uncommitted
        )
        try:
            if self.queues is not None:
                return await self._next_tenant_batch(
                    self.queues, collected, admit, stop, block_ms, between_reads
                )
            return await self._fill(collected, admit, stop, block_ms)
        except REDIS_ERRORS:
            # Nothing is lost: the next call admits them again (into a fresh batch).
            self._backlog = [held.entry for held in collected.held] + self._unread + self._backlog
            self._carried_acks = collected.ack_with_step
            raise

    async def _fill(
        self, collected: Collected, admit: Admit, stop: asyncio.Event, block_ms: int
    ) -> Collected | None:
        """next_batch's batch, one adapter for all."""
        in_batch: set[str] = set()
        limit = self.batch_size
        while len(collected.held) < limit:
            if stop.is_set():
                return None
            need = limit - len(collected.held)
            if self._backlog:
                entries, self._backlog = self._backlog[:need], self._backlog[need:]
            else:
                entries = await self.consumer.read(need, block_ms=block_ms)
            self._unread = entries
            losses = await self.unfinished.counts([entry.entry_id for entry in entries])
            for i, entry in enumerate(entries):
                self._unread = entries[i:]  # an entry is read again until it is dealt with
                lost = losses.get(entry.entry_id, 0)
                fits = step_limit(lost, self.batch_size, self.loss_retries)
                if 0 < min(fits, limit) <= len(collected.held):
                    self._backlog = entries[i:] + self._backlog  # it opens the next step
                    self._unread = []
                    return collected
                sample = await admit(entry, in_batch=in_batch, lost=lost)
                if not isinstance(sample, Sample):
                    if lost:  # dealt with here: nothing left to count
                        await self.unfinished.finish([entry.entry_id])
                    if isinstance(sample, str):
                        collected.ack_with_step.append(sample)
                    continue
                in_batch.add(sample.sample_id)
                collected.held.append(Held(sample, entry))
                limit = min(limit, fits)
            self._unread = []
        return collected

    async def _next_tenant_batch(
        self,
        queues: TenantQueues[Held],
        collected: Collected,
        admit: Admit,
        stop: asyncio.Event,
        block_ms: int,
        between_reads: Callable[[], Awaitable[None]] | None,
    ) -> Collected | None:
        """The next adapter's batch in the queues' fair order, reading until one is full; what
        to acknowledge with its step gathers in `collected`."""
        while True:
            if between_reads is not None:
                await between_reads()
            if (ready := queues.pop_ready()) is not None:
                collected.tenant, collected.held = ready
                return collected
            if stop.is_set():
                return None
            if self._backlog:
                entries = self._backlog[: self.batch_size]
                self._backlog = self._backlog[self.batch_size :]
            else:
                entries = await self.consumer.read(self.batch_size, block_ms=block_ms)
            self._unread = entries
            losses = await self.unfinished.counts([entry.entry_id for entry in entries])
            waiting = {held.sample.sample_id for held in queues.held()}
            for i, entry in enumerate(entries):
                self._unread = entries[i:]  # an entry is read again until it is dealt with
                lost = losses.get(entry.entry_id, 0)
                sample = await admit(entry, in_batch=waiting, lost=lost)
                if not isinstance(sample, Sample):
                    if lost:
                        await self.unfinished.finish([entry.entry_id])
                    if isinstance(sample, str):
                        collected.ack_with_step.append(sample)
                    continue
                overflow = queues.overflow
                adapter = queues.put(sample.tenant, Held(sample, entry), sample.weight_version)
                if isinstance(adapter, Unroutable):  # its adapter was reset, removed, unrouted
                    await self._drop(entry, adapter.reason, sample)
                    if lost:
                        await self.unfinished.finish([entry.entry_id])
                    continue
                waiting.add(sample.sample_id)
                if queues.overflow > overflow:
                    self.metrics.tenant_overflow.inc()
            self._unread = []

    async def release_tenant(self, tenant: str) -> int:
        """Free `tenant`'s adapter slot (a reset or remove); the samples waiting for its adapter
        are dropped (acknowledged, counted as tenant_reset). How many were dropped."""
        if self.queues is None:
            return 0
        held = self.queues.release(tenant)
        for item in held:
            await self._drop(item.entry, "tenant_reset", item.sample)
        return len(held)

    async def _admit(
        self,
        entry: Entry,
        policy_version: CurrentVersion,
        trained: Callable[[str], bool],
        uncommitted: set[str],
        in_batch: set[str],
        lost: int,
    ) -> Sample | str | None:
        """The sample to train; an entry id to acknowledge with the step; or None when the
        entry was dealt with here. `lost`: steps with it that lost the backend."""
        consumed = self.metrics.samples_consumed
        try:
            sample = decode_entry(entry.fields, Sample)
        except RecordError as exc:
            return await self._drop_bad(entry, "undecodable", str(exc))
        if trained(sample.sample_id):
            return await self._drop(entry, "duplicate", sample)
        if sample.sample_id in uncommitted or sample.sample_id in in_batch:
            consumed.labels("dropped").inc()
            self.metrics.samples_dropped.labels("duplicate").inc()
            return entry.entry_id
        if not is_trainable(sample):
            await self.consumer.ack(entry.entry_id)
            consumed.labels("masked").inc()
            return None
        current = policy_version(sample) if callable(policy_version) else policy_version
        if current - sample.policy_version > self.max_staleness:
            return await self._drop(entry, "stale", sample)
        try:
            # A sample of another judging mode is dead-lettered, not refused at start: the
            # trainer cannot know the judge's mode before samples arrive (another deployment;
            # a mode switch leaves the old mode's samples on the stream), and stopping on one
            # would crash-loop on its pending entry. Dead-lettered, it keeps its data and reason
            # for a replay once the two agree, and `samples_dropped{reason="mode"}` shows it.
            check_mode(sample, self.estimator)
            check_sample(sample, self.vocab_size, self.max_length)
        except ModeMismatch as exc:
            return await self._drop_bad(entry, "mode", str(exc))
        except BadSample as exc:
            return await self._drop_bad(entry, "invalid", str(exc))
        if step_limit(lost, self.batch_size, self.loss_retries) == 0:
            return await self._drop_bad(
                entry,
                "backend_lost",
                f"the training backend was lost in {lost} steps with this sample, the last "
                "with it alone",
            )
        return sample

    # Counted once done: an entry whose acknowledgement failed is read and dropped again.
    async def _drop(self, entry: Entry, reason: str, sample: Sample) -> None:
        await self.consumer.ack(entry.entry_id)
        self.metrics.samples_consumed.labels("dropped").inc()
        self.metrics.samples_dropped.labels(reason).inc()
        log.info("dropped sample %s (%s, policy version %d)",
                 sample.sample_id, reason, sample.policy_version)  # fmt: skip

    async def _drop_bad(self, entry: Entry, reason: str, detail: str) -> None:
        await self.consumer.dead_letter(entry, detail)
        self.metrics.samples_consumed.labels("dropped").inc()
        self.metrics.samples_dropped.labels(reason).inc()
