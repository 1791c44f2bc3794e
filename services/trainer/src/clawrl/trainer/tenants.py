"""Per-tenant batches (`[tenants] mode = "per_tenant"`): which adapter a sample trains, and
which tenant's batch goes next.

Each sample trains exactly one adapter, the one that served it (`route`): a turn served by its
tenant's adapter (`Sample.weight_version` is `tenant-T-vN`) trains that adapter, one served by the
shared policy trains the shared policy when its tenant has no adapter. A selected tenant's
adapter starts from the shared policy's turns: while it has no exported version yet (new, or
reset), the tenant is served the shared policy and its samples train its adapter, a copy of the
shared one; once it has one, a turn the shared policy still served (a sync's lag) is dropped
(SERVED_SHARED), so no tenant's words reach the policy that serves the others. A tenant gets an
adapter when it is selected (`allow`/`pattern`), not removed, and there is room (`max_adapters`); a
reset or a remove frees its slot. Samples of an adapter that was reset or removed since they were
served (below the tenant's version floor), or of a tenant no longer selected, are dropped.
Samples wait in one queue per adapter; a tenant's step takes `min_samples_per_step` of its own
samples, the shared policy's takes `train.batch_size`. Among the queues that hold a batch, the
one whose last step is the oldest goes first (round robin), so a busy tenant whose queue is
always full cannot starve a quiet one: once the quiet one has a batch, it is next.

Operations (`clawrl-trainer tenants ...`): list the tenants; reset one (its adapter is dropped,
its slot freed, and it is served the shared policy until a new adapter of its own, a copy of the
shared one, is exported); remove one (the same, and it gets no adapter again until a reset);
export one's newest version as a flat PEFT directory. Reset and remove are requests on the resets
stream, `{versions_stream}:tenants:resets`, that the running trainer applies before its next
step, or at its next start: see Trainer.apply_resets.
"""

from __future__ import annotations

import asyncio
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from clawrl.common import redis_client
from clawrl.common.tenants import (
    SHARED,
    TENANT_ID,
    TenantSettings,
    is_tenant_id,
    parse_tenant_adapter,
)
from clawrl.trainer.checkpoints import CheckpointStore, TrainerState
from clawrl.trainer.settings import TrainerSettings

T = TypeVar("T")


def adapter_of(tenant: str, settings: TenantSettings, owners: set[str]) -> str:
    """The adapter a sample of `tenant` trains: the tenant's own, or SHARED. `owners`: the
    tenants that have an adapter already (a new one gets one while there is room)."""
    if not settings.owns_adapter(tenant):
        return SHARED
    if tenant in owners or len(owners) < settings.max_adapters:
        return tenant
    return SHARED


def served_version(tenant: str, weight_version: str) -> int | None:
    """The version of `tenant`'s own adapter that served a sample (its weight_version names
    the adapter under LoRA); None when the shared policy served it."""
    parsed = parse_tenant_adapter(weight_version)
    return parsed[1] if parsed is not None and parsed[0] == tenant else None


@dataclass(frozen=True)
class Unroutable:
    """A sample no adapter may train; `reason` is its samples_dropped reason."""

    reason: str


# A tenant's adapter was reset or removed after its version served the sample.
RESET = Unroutable("tenant_reset")
# The tenant's adapter served it, but the tenant no longer has one (taken out of allow/pattern).
UNROUTED = Unroutable("tenant_unrouted")
# The shared policy served a tenant whose adapter was exported already (the sync had not reached
# the gateway yet). Training the shared policy on it would carry this tenant's words to every
# tenant the shared policy serves; training the adapter on it would measure it against another
# version's weights. It is dropped: a few turns of a sync's lag.
SERVED_SHARED = Unroutable("tenant_served_shared")


def route(
    tenant: str,
    weight_version: str,
    settings: TenantSettings,
    owners: set[str],
    versions: dict[str, int],
    floors: dict[str, int],
    removed: set[str],
) -> str | Unroutable:
    """The adapter a sample trains: the one that served it (see the module docstring).
    `versions`: each tenant's last exported version; `floors`: the first version of its
    current adapter (1 unless reset or removed); `removed`: tenants barred from an adapter."""
    floor = floors.get(tenant, 1)
    eligible = tenant not in removed
    own = served_version(tenant, weight_version)
    if own is not None:
        if own < floor:
            return RESET
        if not (eligible and tenant in owners and settings.owns_adapter(tenant)):
            return UNROUTED
        return tenant
    if not eligible:
        return SHARED
    adapter = adapter_of(tenant, settings, owners)
    if adapter != SHARED and versions.get(tenant, 0) >= floor:
        return SERVED_SHARED  # its adapter is exported, yet the shared policy served this turn
    return adapter


@dataclass
class TenantQueues(Generic[T]):
    """Held samples per adapter, and the fair order of their steps (see the module docstring)."""

    settings: TenantSettings
    batch_size: int  # of the shared policy's steps
    owners: set[str] = field(default_factory=set)  # tenants with an adapter
    queues: OrderedDict[str, list[T]] = field(default_factory=OrderedDict)
    last_step: dict[str, int] = field(default_factory=dict)  # adapter -> steps taken before
    steps: int = 0
    overflow: int = 0  # samples of selected tenants that found no room (trained shared)
    # The trainer's state (per tenant): last exported version, version floor; removed tenants.
    versions: dict[str, int] = field(default_factory=dict)
    floors: dict[str, int] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)

    def put(self, tenant: str, item: T, weight_version: str = "") -> str | Unroutable:
        """Queue `item` of `tenant` (served by `weight_version`); the adapter it will train, or
        why none may (then it is not queued)."""
        adapter = route(tenant, weight_version, self.settings, self.owners, self.versions,
                        self.floors, self.removed)  # fmt: skip
        if isinstance(adapter, Unroutable):
            return adapter
        if (adapter == SHARED and tenant not in self.owners and tenant not in self.removed
                and self.settings.owns_adapter(tenant)):  # fmt: skip
            self.overflow += 1
        if adapter != SHARED:
            self.owners.add(adapter)
        self.queues.setdefault(adapter, []).append(item)
        return adapter

    def need(self, adapter: str) -> int:
        return self.batch_size if adapter == SHARED else self.settings.min_samples_per_step

    def pop_ready(self) -> tuple[str, list[T]] | None:
        """The batch that goes next, taken out of its queue; None while no queue holds one.
        Order: the adapter that stepped longest ago (never: first), then the queue that
        started waiting first."""
        ready = [a for a, queue in self.queues.items() if len(queue) >= self.need(a)]
        if not ready:
            return None
        adapter = min(ready, key=lambda a: self.last_step.get(a, -1))
        size = self.need(adapter)
        batch, rest = self.queues[adapter][:size], self.queues[adapter][size:]
        if rest:
            self.queues[adapter] = rest
        else:
            del self.queues[adapter]
        self.last_step[adapter] = self.steps
        self.steps += 1
        return adapter, batch

    def held(self) -> list[T]:
        """Every item waiting, in no particular order."""
        return [item for queue in self.queues.values() for item in queue]

    def release(self, tenant: str) -> list[T]:
        """Free `tenant`'s slot (a reset or remove): its adapter's waiting items, taken out."""
        self.owners.discard(tenant)
        self.last_step.pop(tenant, None)
        return self.queues.pop(tenant, [])


# --- `clawrl-trainer tenants` --------------------------------------------------------------------


def tenant_rows(
    state: TrainerState | None, store: CheckpointStore
) -> list[tuple[str, int, int, str]]:
    """(tenant, steps, version, export path) of every tenant in the newest durable state, the
    shared policy first (tenant "-"); an export path is "" until the first export."""
    if state is None:
        return []
    shared = state.policy_version
    shared_path = str(store.policies / f"v{shared}") if shared else ""
    rows = [("-", state.tenant_steps.get(SHARED, state.step), shared, shared_path)]
    for tenant in sorted(set(state.tenant_steps) - {SHARED}):
        version = state.tenant_versions.get(tenant, 0)
        if version < state.tenant_floors.get(tenant, 1):
            version = 0  # a new adapter since a reset: nothing exported of it yet
        path = store.policies / f"tenant-{tenant}" / f"v{version}"
        rows.append((tenant, state.tenant_steps[tenant], version, str(path) if version else ""))
    return rows


def print_tenants(settings: TrainerSettings) -> None:
    """The table `clawrl-trainer tenants` prints."""
    store = CheckpointStore(settings.checkpoint)
    found = store.latest_state()
    rows = tenant_rows(found[0] if found else None, store)
    if not rows:
        print(f"no durable state in {store.root}: nothing trained yet")
        return
    print(f"{'tenant':<20} {'steps':>6} {'version':>8}  export")
    for tenant, steps, version, path in rows:
        print(f"{tenant:<20} {steps:>6} {version:>8}  {path or '-'}")


def resets_stream(versions_stream: str) -> str:
    """Where `clawrl-trainer tenants reset` asks the trainer to reset a tenant's adapter: a
    stream, so a request made while the trainer is down is applied when it starts."""
    return f"{versions_stream}:tenants:resets"


class TenantCommandError(Exception):
    """A tenants command that cannot be done; the message says why (printed, exit 1)."""


# What a request on the resets stream asks (its `action` field; none: reset).
RESET_ACTIONS = ("reset", "remove")


def request_reset(settings: TrainerSettings, tenant: str, action: str = "reset") -> str:
    """Ask the trainer to reset `tenant` (or remove it: `action`); the entry id."""
    if action not in RESET_ACTIONS:
        raise TenantCommandError(f"{action!r} is not one of {', '.join(RESET_ACTIONS)}")
    if not settings.tenants.per_tenant:
        raise TenantCommandError(f"tenants.mode is shared: no tenant has an adapter to {action}")
    if not is_tenant_id(tenant):
        raise TenantCommandError(f"{tenant!r} is not a tenant id ({TENANT_ID.pattern})")

    async def add() -> str:
        redis = redis_client.connect(settings.redis, socket_timeout=settings.redis.socket_timeout_s)
        try:
            stream = resets_stream(settings.redis.versions_stream)
            entry_id = await redis.xadd(
                stream, {"tenant": tenant, "action": action}, maxlen=1000, approximate=True
            )
        finally:
            await redis.aclose()
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    return asyncio.run(add())


def export_tenant(settings: TrainerSettings, tenant: str, out: Path) -> tuple[int, Path]:
    """Copy `tenant`'s newest exported version (of the newest durable state) to `out`, a flat
    PEFT adapter directory; (version, source)."""
    store = CheckpointStore(settings.checkpoint)
    found = store.latest_state()
    versions = found[0].tenant_versions if found else {}
    floors = found[0].tenant_floors if found else {}
    # Versions below the floor are of an adapter since reset or removed: not the tenant's.
    versions = {t: v for t, v in versions.items() if v >= floors.get(t, 1)}
    version = versions.get(tenant, 0)
    if not version:
        known = ", ".join(sorted(t for t, v in versions.items() if v)) or "none"
        raise TenantCommandError(
            f"tenant {tenant!r} has no exported version in {store.root} (tenants with one: {known})"
        )
    source = store.policies / f"tenant-{tenant}" / f"v{version}"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TenantCommandError(f"{out} exists and is not an empty directory: give a new one")
    if out.exists():
        out.rmdir()
    shutil.copytree(source, out)
    return version, source
