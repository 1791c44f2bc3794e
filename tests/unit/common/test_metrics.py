"""The garbage collector's metrics and the start-up freeze shared by the serving processes."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry

from clawrl.common.metrics import GarbageCollection


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


@pytest.fixture
def collector():
    """Automatic collections off, so only the test's own `gc.collect` calls are counted."""
    registry = CollectorRegistry()
    collector = GarbageCollection("test")
    collector.install(registry)
    gc.disable()
    yield collector, registry
    gc.enable()
    collector.uninstall(registry)
    gc.unfreeze()


def test_collections_and_their_pauses_are_counted_by_generation(collector):
    _, registry = collector
    before = sample(registry, "clawrl_test_gc_collections_total", generation="2")
    paused = sample(registry, "clawrl_test_gc_pause_seconds_total", generation="2")
    gc.collect(2)
    assert sample(registry, "clawrl_test_gc_collections_total", generation="2") == before + 1
    assert sample(registry, "clawrl_test_gc_pause_seconds_total", generation="2") > paused


def test_freezing_takes_the_start_up_objects_out_of_collection(collector):
    collector, registry = collector
    built_at_start = [[i] for i in range(10_000)]  # container objects: the collector tracks them
    frozen = collector.freeze()
    assert frozen >= len(built_at_start)
    # The gauge reads the count at scrape time: a frozen object freed since (by another thread,
    # say) has left it, so it may be a little below what freeze() saw, never above.
    assert len(built_at_start) <= sample(registry, "clawrl_test_gc_frozen_objects") <= frozen
    # A full collection no longer visits them: it sees only what was made since.
    assert not any(obj is built_at_start for obj in gc.get_objects(generation=2))


def test_uninstalled_it_leaves_the_collector_and_the_registry(collector):
    collector, registry = collector
    collector.uninstall(registry)
    assert collector._on_gc not in gc.callbacks
    assert registry.get_sample_value("clawrl_test_gc_frozen_objects") is None
    collector.install(registry)  # for the fixture's teardown
