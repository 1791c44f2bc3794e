"""Shard naming (common/shards.py) and the rule it exists for: every key one script or MULTI
touches hashes to one Redis Cluster slot (gateway session scripts, the judge's commit, a
consumer's dead-lettering), for sessions of every shard."""

from __future__ import annotations

import uuid

import pytest
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from clawrl.common.feedback import feedback_key
from clawrl.common.shards import Shards, shard_of, shard_tag
from clawrl.gateway.sessions import SessionStore, caller_scope, session_member
from clawrl.judge.service import build_store
from clawrl.judge.settings import JudgeSettings


def slot(key: str) -> int:
    return key_slot(key.encode())


class ScriptsOnly:
    """What SessionStore and JudgeStore ask of a client when built: only register_script."""

    def register_script(self, script: str) -> str:
        return script


def sessions(shards: Shards, per_shard: int) -> list[str]:
    found: dict[int, list[str]] = {k: [] for k in range(shards.count)}
    while min(len(ids) for ids in found.values()) < per_shard:
        session_id = f"s-{uuid.uuid4().hex[:8]}"
        found[shards.of(session_id)].append(session_id)
    return [sid for ids in found.values() for sid in ids]


def test_one_unsharded_redis_keeps_the_configured_names() -> None:
    shards = Shards()
    assert shards.names("clawrl:turns") == ["clawrl:turns"]
    assert shards.of("any session") == 0
    assert not shards.tagged
    with pytest.raises(ValueError):
        shards.name("clawrl:turns", 1)


@pytest.mark.parametrize("count", [1, 3, 4, 16])
def test_each_shard_has_its_own_slot_range(count: int) -> None:
    """Shard k's slot lies in the k-th of `count` equal slot ranges: `--cluster create` gives
    each primary one range, so shards spread over the primaries."""
    shards = Shards(count, cluster=True)
    for k, name in enumerate(shards.names("clawrl:turns")):
        assert name == f"clawrl:turns:{{{shard_tag(k, count)}}}"
        low = k * REDIS_CLUSTER_HASH_SLOTS // count
        assert low <= slot(name) < (k + 1) * REDIS_CLUSTER_HASH_SLOTS // count


def test_a_configured_name_with_its_own_hash_tag_is_refused_when_sharded() -> None:
    assert Shards().name("clawrl:{x}:turns", 0) == "clawrl:{x}:turns"
    with pytest.raises(ValueError, match="must not hold"):
        Shards(3).name("clawrl:{x}:turns", 0)


def test_sessions_spread_over_the_shards_stably() -> None:
    counts = [0, 0, 0]
    for i in range(3000):
        counts[shard_of(f"session-{i}", 3)] += 1
    assert min(counts) > 900  # about a third each
    assert shard_of("session-7", 3) == shard_of("session-7", 3)
    with pytest.raises(ValueError):
        Shards(0)


@pytest.mark.parametrize("count", [1, 3])
def test_every_gateway_script_touches_one_slot(count: int) -> None:
    shards = Shards(count, cluster=True)
    store = SessionStore(ScriptsOnly(), prefix="clawrl:gw", stream="clawrl:turns",  # type: ignore[arg-type]
                         maxlen=10, ttl_s=60, shards=shards)  # fmt: skip
    for session_id in sessions(shards, per_shard=3):
        shard = shards.of(session_id)
        conversation = store.conversation_key("scope", "hash", shard)
        for step in ("record", "finalize"):
            member = session_member(caller_scope("sk-key", None), session_id)
            keys = [*store._keys("req-1", step, member), conversation]
            assert len({slot(key) for key in keys}) == 1, keys
        # The resolution's MGET of one shard: the request key and the shard's claims.
        keys = [store.request_key("req-1", "record", shard), conversation]
        assert len({slot(key) for key in keys}) == 1


@pytest.mark.parametrize("count", [1, 3])
def test_the_judge_commit_and_dead_letters_touch_one_slot(count: int) -> None:
    settings = JudgeSettings(redis={"cluster": True, "stream_shards": count})
    shards = settings.redis.shards()
    for k in range(count):
        config = build_store(settings, ScriptsOnly(), shard=k).config  # type: ignore[arg-type]
        for session_id in sessions(shards, per_shard=2):
            if shards.of(session_id) != k:
                continue
            turn_id = f"{session_id}:abc:0"
            keys = [
                f"{config.prefix}:done:{turn_id}",
                f"{config.prefix}:session:{session_id}",
                config.samples_stream,
                config.audit_stream,
                config.turns_stream,
                feedback_key(config.feedback_prefix or "", turn_id),
                shards.name(settings.redis.deadletter_stream, k),
            ]
            assert len({slot(key) for key in keys}) == 1, keys
