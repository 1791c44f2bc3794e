"""Per-tenant batches (`[tenants] mode = "per_tenant"`): which adapter a sample trains, and
which tenant's batch goes next.

Each sample trains exactly one adapter: its tenant's when the tenant is selected for one (and
has one, or there is room for one more: `max_adapters`), else the shared policy's (`SHARED`).
Samples wait in one queue per adapter; a tenant's step takes `min_samples_per_step` of its own
samples, the shared policy's takes `train.batch_size`. Among the queues that hold a batch, the
one whose last step is the oldest goes first (round robin), so a busy tenant whose queue is
always full cannot starve a quiet one: once the quiet one has a batch, it is next.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from clawrl.common.tenants import SHARED, TenantSettings
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
