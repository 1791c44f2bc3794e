"""What the gateways route to: the LoRA version a weight sync put into service, kept in one
Redis hash so that a gateway that (re)starts, and the launcher that reloads adapters into
restarted engines, learn it without asking anyone.

The weight-sync job writes it once every engine has loaded the adapter and before it switches
the gateways; the hash is `{version, adapter, path, updated_at}`. Full-weight syncs clear the
adapter (the engines' own weight_version says what they serve). Tenants' adapters (per-tenant
mode) are recorded beside it, one field per tenant (`tenants_key`), by the tenant's syncs; the
trainer deletes a tenant's field when it resets or removes the tenant's adapter.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis

log = logging.getLogger(__name__)


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


# --- per-tenant adapters ([tenants] mode = "per_tenant") ---------------------------------------


def tenants_key(served_key: str) -> str:
    """The hash beside `served_key` that records each tenant's served adapter (field: tenant,
    value: `version`, tab, `adapter`, tab, `path`); the shared record stays as it was."""
    return f"{served_key}:tenants"


async def read_served_tenants(redis: Redis, served_key: str) -> dict[str, Served]:
    """Each tenant's served adapter; a malformed field is logged and left out (one bad entry
    must not keep every other tenant from its adapter)."""
    served = {}
    for tenant, value in (await redis.hgetall(tenants_key(served_key))).items():
        parts = value.decode().split("\t")
        try:
            served[tenant.decode()] = Served(int(parts[0]), parts[1], parts[2])
        except (IndexError, ValueError):
            log.error("malformed served adapter of tenant %s at %s: %r",
                      tenant.decode(), tenants_key(served_key), value)  # fmt: skip
    return served


async def write_served_tenant(
    redis: Redis, served_key: str, tenant: str, version: int, adapter: str, path: str
) -> None:
    await redis.hset(tenants_key(served_key), tenant, f"{version}\t{adapter}\t{path}")


async def delete_served_tenant(redis: Redis, served_key: str, tenant: str) -> bool:
    """Forget `tenant`'s served adapter (its adapter was reset or removed): gateways that
    start, and the launcher, no longer route it; whether there was one."""
    return bool(await redis.hdel(tenants_key(served_key), tenant))
