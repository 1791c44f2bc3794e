"""`clawrl simulate` reads the judge's rewards back from every shard of the samples stream: with
`[redis] stream_shards` above 1 the samples are on `clawrl:samples:{s0}`.., and reading only the
configured name found none of them."""

from __future__ import annotations

import asyncio

import pytest
from redis import Redis

from clawrl.common.proto.records_pb2 import Sample
from clawrl.common.records import encode_entry
from clawrl.common.settings import RedisSettings
from clawrl.simulate.main import judged_rewards

pytestmark = pytest.mark.integration


def test_rewards_are_read_from_every_shard(redis_url) -> None:
    settings = RedisSettings(url=redis_url, stream_shards=2)
    shards = settings.shards()
    client = Redis.from_url(redis_url)
    samples = [
        ("sim-r1-0", 0, 1.0),
        ("sim-r1-3", 1, -1.0),
        ("sim-r1-7", 1, 1.0),
        ("other-0", 1, 1.0),
    ]
    for session_id, version, reward in samples:
        sample = Sample(session_id=session_id, policy_version=version, reward=reward, loss_mask=[1])
        client.xadd(shards.name("clawrl:samples", shards.of(session_id)), encode_entry(sample))
    # The three sessions of run r1 are spread over both shards, or the test proves nothing.
    assert {shards.of(session) for session, _, _ in samples[:3]} == {0, 1}
    found = asyncio.run(judged_rewards(settings, "clawrl:samples", "sim-r1-", 3, settle_s=0))
    assert sorted(found) == [(0, 1.0), (1, -1.0), (1, 1.0)]
