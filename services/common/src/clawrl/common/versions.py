"""Policy versions: the trainer announces "version N is ready at PATH" on the versions stream;
the weight-sync job consumes the announcements and loads the newest into the policy engines.

An announcement is a stream entry `{version, path, step, created_at}`; the stream is the
contract between the two, so both sides build and read entries here. The tenants' stream
(per-tenant mode) also carries each tenant's release (`TenantReleased`: its adapter was reset or
removed), in order with its versions.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from clawrl.common.redis_text import text, text_fields


@dataclass(frozen=True)
class VersionReady:
    """A policy checkpoint that the policy engines can load: full weights
    (`/update_weights_from_disk`) or, when `adapter` names it, a LoRA adapter
    (`/load_lora_adapter`, served beside the others with no pause)."""

    version: int
    path: str  # HF safetensors or PEFT adapter directory, as the engines see it (shared volume)
    step: int
    created_at: float
    adapter: str = ""  # the adapter's name ("policy-v3") when `path` is a LoRA adapter
    tenant: str = ""  # whose adapter it is ("tenant-<id>-v3"); "" for the shared policy

    @property
    def is_adapter(self) -> bool:
        return bool(self.adapter)

    def fields(self) -> dict[str, str]:
        fields = {
            "version": str(self.version),
            "path": self.path,
            "step": str(self.step),
            "created_at": repr(self.created_at),
            "adapter": self.adapter,
        }
        if self.tenant:  # a shared version's entry stays as it was
            fields["tenant"] = self.tenant
        return fields

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> VersionReady:
        """Parse an entry; ValueError when a field is missing or malformed."""
        values = text_fields(fields)
        try:
            return cls(
                version=int(values["version"]),
                path=values["path"],
                step=int(values.get("step", "0")),
                created_at=float(values.get("created_at", "0")),
                adapter=values.get("adapter", ""),
                tenant=values.get("tenant", ""),
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"malformed version announcement {values!r}: {exc}") from exc


@dataclass(frozen=True)
class TenantReleased:
    """An entry of the tenants' versions stream beside the versions: the trainer dropped
    `tenant`'s adapter (`clawrl-trainer tenants reset|remove`, `action`). None of its versions
    below `floor` may serve it again: the launcher unroutes it from the running gateways (they
    serve it the shared policy) and never syncs those versions, announced before or not."""

    tenant: str
    floor: int  # the first version of its next adapter
    action: str = "reset"  # reset | remove
    created_at: float = 0.0

    def fields(self) -> dict[str, str]:
        return {
            "tenant": self.tenant,
            "released": self.action,
            "floor": str(self.floor),
            "created_at": repr(self.created_at),
        }


def tenant_entry(fields: dict[bytes | str, bytes | str]) -> VersionReady | TenantReleased:
    """Parse an entry of the tenants' versions stream: a version, or a release (it has
    `released`); ValueError when malformed."""
    values = text_fields(fields)
    if "released" not in values:
        return VersionReady.from_fields(fields)
    try:
        if not values.get("tenant"):
            raise KeyError("tenant")
        return TenantReleased(
            tenant=values["tenant"],
            floor=int(values["floor"]),
            action=values["released"],
            created_at=float(values.get("created_at", "0")),
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(f"malformed tenant release {values!r}: {exc}") from exc


async def announce(
    redis: Redis, stream: str, ready: VersionReady | TenantReleased, maxlen: int = 1000
) -> str:
    """XADD the announcement (or a tenant's release); returns the entry id."""
    entry_id = await redis.xadd(stream, ready.fields(), maxlen=maxlen, approximate=True)
    return text(entry_id)


def adapter_name(version: int) -> str:
    """The name a policy version's LoRA adapter is loaded and requested under."""
    return f"policy-v{version}"


async def latest(redis: Redis, stream: str) -> VersionReady | None:
    """The newest announcement on the stream, None when there is none."""
    entries = await redis.xrevrange(stream, count=1)
    return VersionReady.from_fields(entries[0][1]) if entries else None


async def newest_per_tenant(redis: Redis, stream: str) -> dict[str, int]:
    """The newest version announced for each tenant on the tenants' versions stream (its
    length is capped, so it is read whole); releases and malformed entries are skipped."""
    newest: dict[str, int] = {}
    for _, entry in await redis.xrange(stream):
        try:
            ready = tenant_entry(entry)
        except ValueError:
            continue
        if isinstance(ready, VersionReady) and ready.tenant:
            newest[ready.tenant] = max(newest.get(ready.tenant, 0), ready.version)
    return newest
