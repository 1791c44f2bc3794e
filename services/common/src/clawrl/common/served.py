"""What the gateways route to: the LoRA version a weight sync put into service, kept in one
Redis hash so that a gateway that (re)starts, and the launcher that reloads adapters into
restarted engines, learn it without asking anyone.

The weight-sync job writes it once every engine has loaded the adapter and before it switches
the gateways; the hash is `{version, adapter, path, updated_at}`. Full-weight syncs clear the
adapter (the engines' own weight_version says what they serve).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis


@dataclass(frozen=True)
class Served:
    """The policy version the gateways route new requests to."""

    version: int
    adapter: str = ""  # "" = full weights, no adapter on the requests
    path: str = ""  # where the adapter is, as the engines see it (to reload it)
    updated_at: float = 0.0


async def read_served(redis: Redis, key: str) -> Served | None:
    """The recorded served version; None when none was recorded. ValueError when malformed."""
    raw = await redis.hgetall(key)
    if not raw:
        return None
    text = {k.decode(): v.decode() for k, v in raw.items()}
    try:
        return Served(
            version=int(text["version"]),
            adapter=text.get("adapter", ""),
            path=text.get("path", ""),
            updated_at=float(text.get("updated_at", "0")),
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(f"malformed served version at {key}: {text!r}") from exc


async def write_served(redis: Redis, key: str, version: int, adapter: str, path: str) -> None:
    await redis.hset(
        key,
        mapping={
            "version": str(version),
            "adapter": adapter,
            "path": path,
            "updated_at": repr(time.time()),
        },
    )
