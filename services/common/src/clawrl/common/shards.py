"""Sharding the data plane over Redis Cluster hash slots (pure: names and hashing only).

A shard is one hash slot. Everything a Lua script or a MULTI touches together lives in one
shard, because Redis Cluster refuses a script whose keys hash to different slots: shard `k`
holds its turn stream, its sample stream, its dead letters, its audit stream, the gateway's
state of the sessions hashed to it, and the judge's markers for their turns. A session's shard
is a hash of its session id, so all of a session's turns go through one shard, in order.

Key names: on one Redis with one shard (the default) every name is the configured one
(`clawrl:turns`, `clawrl:gw:s:{session_id}`), exactly as before sharding existed. Otherwise
shard `k`'s name of a key is the configured name followed by the shard's hash tag:
`clawrl:turns:{s0}`, and a prefix becomes `clawrl:gw:{s0}`, so `clawrl:gw:{s0}:s:{session_id}`
hashes to the shard's slot whatever the session id holds.

The tags are chosen so that shard `k`'s slot lies in the `k`-th of `count` equal ranges of the
16384 slots: `redis-cli --cluster create` gives each primary one contiguous range, so with as
many shards as primaries (or a multiple) every primary gets its share.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot


@cache
def shard_tag(index: int, count: int) -> str:
    """The hash tag of shard `index` of `count`: the first of `s{index}`, `s{index}.1`,
    `s{index}.2`, ... whose slot is in the shard's range of slots."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} is not one of {count}")
    low = index * REDIS_CLUSTER_HASH_SLOTS // count
    high = (index + 1) * REDIS_CLUSTER_HASH_SLOTS // count
    attempt = 0
    while True:
        tag = f"s{index}" if attempt == 0 else f"s{index}.{attempt}"
        if low <= key_slot(tag.encode()) < high:
            return tag
        attempt += 1


def shard_of(key: str, count: int) -> int:
    """The shard of a session id (stable across processes and Python versions)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


@dataclass(frozen=True)
class Shards:
    """How many shards there are, and whether names carry hash tags (`tagged`: a cluster, or
    more than one shard)."""

    count: int = 1
    cluster: bool = False
    tagged: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"stream_shards must be at least 1, not {self.count}")
        object.__setattr__(self, "tagged", self.cluster or self.count > 1)

    def name(self, base: str, index: int) -> str:
        """Shard `index`'s name of a key (or key prefix) configured as `base`."""
        if not self.tagged:
            if index != 0:
                raise ValueError(f"shard {index} of an unsharded store")
            return base
        if "{" in base:
            # Its own hash tag would win over the shard's: every shard in one slot.
            raise ValueError(f"a sharded key name must not hold '{{': {base!r}")
        return f"{base}:{{{shard_tag(index, self.count)}}}"

    def names(self, base: str) -> list[str]:
        """Every shard's name of `base`, shard 0 first."""
        return [self.name(base, index) for index in range(self.count)]

    def of(self, session_id: str) -> int:
        """The shard a session's state and turns live in."""
        return shard_of(session_id, self.count) if self.count > 1 else 0
