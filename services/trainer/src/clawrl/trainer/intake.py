"""Fills a step's batch from `clawrl:samples` (consumer group `trainers`).

Delivery is at-least-once, so every entry ends in exactly one of these ways:
- trainable: held, trained, and acknowledged only once a durable state includes its step;
- masked (a mask reason / no trained token): acknowledged now, it never fills a batch;
- stale (older than max_staleness policy versions): acknowledged now, counted;
- a sample id already trained (in a durable state): acknowledged now, counted;
- a sample id trained in a step that is not durable yet (or twice in this batch): acknowledged
  together with that step's entries;
- malformed: dead-lettered with the reason (which acknowledges it), counted.
Entries read but not yet part of a step (the trainer stopping mid-batch) stay pending and come
back after a restart: first this consumer's own pending entries are read again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from clawrl.common.records import RecordError, Sample, decode_entry
from clawrl.common.streams import Entry, GroupConsumer
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.samples import BadSample, ModeMismatch, check_mode, check_sample, is_trainable

log = logging.getLogger(__name__)


@dataclass
class Held:
    """A trainable sample and the stream entry it came in."""

    sample: Sample
    entry: Entry

    @property
    def xadd_time_s(self) -> float:
        """When the entry was added (its id's millisecond part)."""
        return int(self.entry.entry_id.partition("-")[0]) / 1000.0


@dataclass
class Collected:
    """A full batch of trainable samples, and entries to acknowledge with its step."""

    held: list[Held] = field(default_factory=list)
    ack_with_step: list[str] = field(default_factory=list)


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
        estimator: str = "grpo",
    ) -> None:
        self.consumer = consumer
        self.metrics = metrics
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.estimator = estimator
        self._backlog: list[Entry] | None = None  # own pending entries, read once at start

    async def next_batch(
        self,
        policy_version: int,
        trained: Callable[[str], bool],
        uncommitted: set[str],
        stop: asyncio.Event,
        block_ms: int = 1000,
    ) -> Collected | None:
        """A batch of `batch_size` trainable samples, or None when `stop` is set first (what
        was read then stays pending). `trained(id)`: the id is in a durable state;
        `uncommitted`: ids trained in steps not durable yet."""
        if self._backlog is None:
            self._backlog = await self.consumer.read_own_pending(count=100_000)
            if self._backlog:
                log.info("taking back %d pending entries of a previous run", len(self._backlog))
        collected = Collected()
        in_batch: set[str] = set()
        while len(collected.held) < self.batch_size:
            if stop.is_set():
                return None
            need = self.batch_size - len(collected.held)
            if self._backlog:
                entries, self._backlog = self._backlog[:need], self._backlog[need:]
            else:
                entries = await self.consumer.read(need, block_ms=block_ms)
            for entry in entries:
                sample = await self._admit(entry, policy_version, trained, uncommitted, in_batch)
                if sample is None:
                    continue
                if isinstance(sample, str):
                    collected.ack_with_step.append(sample)
                    continue
                in_batch.add(sample.sample_id)
                collected.held.append(Held(sample, entry))
        return collected

    async def _admit(
        self,
        entry: Entry,
        policy_version: int,
        trained: Callable[[str], bool],
        uncommitted: set[str],
        in_batch: set[str],
    ) -> Sample | str | None:
        """The sample to train; an entry id to acknowledge with the step; or None when the
        entry was dealt with here."""
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
            consumed.labels("masked").inc()
            await self.consumer.ack(entry.entry_id)
            return None
        if policy_version - sample.policy_version > self.max_staleness:
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
        return sample

    async def _drop(self, entry: Entry, reason: str, sample: Sample) -> None:
        self.metrics.samples_consumed.labels("dropped").inc()
        self.metrics.samples_dropped.labels(reason).inc()
        await self.consumer.ack(entry.entry_id)
        log.info("dropped sample %s (%s, policy version %d)",
                 sample.sample_id, reason, sample.policy_version)  # fmt: skip

    async def _drop_bad(self, entry: Entry, reason: str, detail: str) -> None:
        self.metrics.samples_consumed.labels("dropped").inc()
        self.metrics.samples_dropped.labels(reason).inc()
        await self.consumer.dead_letter(entry, detail)
