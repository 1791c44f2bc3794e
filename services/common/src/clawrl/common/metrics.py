"""Metric helpers shared by the services. Each service owns one metrics module that builds its
metrics on a `CollectorRegistry` it creates at start (no process-wide registry), named
`clawrl_<service>_<what>_<unit>` with bounded labels."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from clawrl.common.tenants import SHARED_LABEL

# Request latencies from a millisecond (gateway overhead) up to minutes (long CPU generations).
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
TOKEN_COUNT_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def tenant_label(adapter: str) -> str:
    """The `tenant` label value of an adapter's series: its tenant's id, or the shared policy's
    label. Only tenants with an adapter of their own get their id as a label value, so the label
    is bounded by tenants.max_adapters + 1."""
    return adapter or SHARED_LABEL


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus text format, with its content type, for a /metrics route."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


class GarbageCollection:
    """The garbage collector as a serving process sees it. `freeze()`, once start-up is done,
    moves every object built so far (the model or tokenizer, torch and transformers: ~350k
    objects) into the permanent generation, so that a full collection no longer rescans them:
    full collections are rare (none in 4,000 gateway requests), but each took 0.3 s on
    2 cores with that heap, a stall for every request in flight. The metrics, named
    `clawrl_<service>_gc_*`, are collections and pause seconds by generation and the frozen
    objects; they are read at scrape time, because the collector's callback may interrupt
    code that holds a metric's lock."""

    def __init__(self, service: str):
        self.service = service
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self._started = 0.0

    def freeze(self) -> int:
        """Collect what start-up left as garbage, then freeze the rest; how many objects."""
        gc.collect()
        gc.freeze()
        return gc.get_freeze_count()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.pause_s[generation] += time.perf_counter() - self._started

    def install(self, registry: CollectorRegistry) -> None:
        gc.callbacks.append(self._on_gc)
        registry.register(self)

    def uninstall(self, registry: CollectorRegistry) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        registry.unregister(self)

    def collect(self) -> Iterator:
        name = f"clawrl_{self.service}_gc"
        pauses = CounterMetricFamily(
            f"{name}_pause_seconds",
            "Time spent in garbage collections (every thread waits), by generation.",
            labels=["generation"],
        )
        counts = CounterMetricFamily(
            f"{name}_collections", "Garbage collections, by generation.", labels=["generation"]
        )
        for generation in range(3):
            pauses.add_metric([str(generation)], self.pause_s[generation])
            counts.add_metric([str(generation)], self.collections[generation])
        yield pauses
        yield counts
        yield GaugeMetricFamily(
            f"{name}_frozen_objects",
            "Objects kept out of garbage collection (what start-up built).",
            value=gc.get_freeze_count(),
        )
