"""A training actor that Ray's memory monitor kills (the host near its memory limit, as under
`make run` beside a test suite) is a lost backend, like any dead actor: the trainer restarts
from its last state with the batch still pending. Before, Ray's OutOfMemoryError was taken for
a batch the backend could not train, and the trainer went on calling the dead actor,
dead-lettering every later sample with the same error."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray

from clawrl.trainer.driver import ActorGroup, BackendLost

pytestmark = pytest.mark.integration


class MemoryHog:
    def step(self) -> int:
        block = bytearray(64 * 2**20)  # held while the memory monitor looks
        time.sleep(20)
        return len(block)


def test_an_actor_killed_by_the_memory_monitor_is_a_lost_backend() -> None:
    # Any use is above 1 % of the host's memory: the monitor kills the running actor at once.
    monitor = {"memory_usage_threshold": 0.01, "memory_monitor_refresh_ms": 100}
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _system_config=monitor)
    try:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        group = ActorGroup([ray.remote(MemoryHog).options(max_restarts=0).remote()])
        with pytest.raises(BackendLost, match="backend actor died"):
            asyncio.run(group.call("step"))
        with pytest.raises(BackendLost):  # and on every later call, never a batch error
            asyncio.run(group.call("step"))
    finally:
        ray.shutdown()
