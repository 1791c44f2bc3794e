"""Per-tenant batches (`[tenants] mode = "per_tenant"`): which adapter a sample trains, and
which tenant's batch goes next.

Each sample trains exactly one adapter: its tenant's when the tenant is selected for one (and
has one, or there is room for one more: `max_adapters`), else the shared policy's (`SHARED`).
Samples wait in one queue per adapter; a tenant's step takes `min_samples_per_step` of its own
samples, the shared policy's takes `train.batch_size`. Among the queues that hold a batch, the
one whose last step is the oldest goes first (round robin), so a busy tenant whose queue is
always full cannot starve a quiet one: once the quiet one has a batch, it is next.

Operations (`clawrl-trainer tenants ...`): list the tenants; reset one's adapter to the shared
policy (a request on the resets stream, `{versions_stream}:tenants:resets`, that the running
trainer applies before its next step, or at its next start: see Trainer.apply_resets); export
one's newest version as a flat PEFT directory.
"""

from __future__ import annotations

import asyncio
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from clawrl.common import redis_client
from clawrl.common.tenants import SHARED, TENANT_ID, TenantSettings, is_tenant_id
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

    def put(self, tenant: str, item: T) -> str:
        """Queue `item` of `tenant`; returns the adapter it will train."""
        adapter = adapter_of(tenant, self.settings, self.owners)
        if adapter == SHARED and self.settings.owns_adapter(tenant):
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


def request_reset(settings: TrainerSettings, tenant: str) -> str:
    """Ask the trainer to reset `tenant`'s adapter to the shared policy; the entry id."""
    if not settings.tenants.per_tenant:
        raise TenantCommandError("tenants.mode is shared: no tenant has an adapter to reset")
    if not is_tenant_id(tenant):
        raise TenantCommandError(f"{tenant!r} is not a tenant id ({TENANT_ID.pattern})")

    async def add() -> str:
        redis = redis_client.connect(settings.redis, socket_timeout=settings.redis.socket_timeout_s)
        try:
            stream = resets_stream(settings.redis.versions_stream)
            entry_id = await redis.xadd(stream, {"tenant": tenant}, maxlen=1000, approximate=True)
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
