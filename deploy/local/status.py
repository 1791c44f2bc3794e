"""The live status line of `make run`: how far the learning loop has turned, read from where the
loop keeps it (the Redis streams and the trainer's /metrics), so it shows the same truth a
cluster's dashboards do."""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field

import redis

from clawrl.common.proto.records_pb2 import Sample
from clawrl.common.records import RecordError, decode_entry
from clawrl.trainer.weight_sync.job import SyncResult

REWARD_WINDOW = 32  # trainable samples the reward mean is taken over


@dataclass
class Snapshot:
    turns: int = 0
    samples_waiting: int = 0
    steps: int = 0
    skipped: int = 0  # batches that took no step: no learning signal in them
    reward_mean: float | None = None
    policy_version: int = 0  # the shared policy's
    tenant_versions: dict[str, int] = field(default_factory=dict)  # per-tenant mode: each adapter's
    last_sync: SyncResult | None = None

    def line(self) -> str:
        reward = f"{self.reward_mean:+.2f}" if self.reward_mean is not None else "-"
        skipped = f" ({self.skipped} batches without signal skipped)" if self.skipped else ""
        text = (
            f"turns {self.turns} | samples waiting {self.samples_waiting} | steps {self.steps}"
            f"{skipped} | reward mean (last {REWARD_WINDOW}) {reward} | "
            f"policy v{self.policy_version}"
        )
        if self.tenant_versions:
            text += " | tenants " + ", ".join(
                f"{tenant} v{version}" for tenant, version in sorted(self.tenant_versions.items())
            )
        sync = self.last_sync
        if sync is not None:
            ago = time.time() - sync.finished_at
            whose = f"{sync.tenant} " if sync.tenant else ""
            text += (
                f" | last sync {whose}v{sync.version} {sync.outcome}, pause {sync.pause_s:.2f}s "
                f"(load {sync.load_s:.2f}s) {ago:.0f}s ago"
            )
        return text


def trainer_counts(metrics_url: str) -> tuple[int, int]:
    """The trainer's step and its batches skipped for lack of signal (0, 0 until it answers)."""
    step = skipped = 0
    try:
        with urllib.request.urlopen(metrics_url, timeout=1) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("clawrl_trainer_step "):
                    step = int(float(line.split()[1]))
                elif line.startswith("clawrl_trainer_batches_skipped_total{"):
                    skipped += int(float(line.split()[-1]))
    except OSError:
        pass
    return step, skipped


def snapshot(client: redis.Redis, trainer_metrics_url: str) -> Snapshot:
    """Where the loop stands now; parts that cannot be read yet keep their zero value."""
    steps, skipped = trainer_counts(trainer_metrics_url)
    state = Snapshot(steps=steps, skipped=skipped)
    state.turns = client.xlen("clawrl:turns")
    try:
        groups = client.xinfo_groups("clawrl:samples")
    except redis.ResponseError:  # no samples yet
        groups = []
    lags = [g.get("lag") for g in groups if g.get("name") in (b"trainers", "trainers")]
    state.samples_waiting = int(lags[0] or 0) if lags else client.xlen("clawrl:samples")
    rewards = []
    for _, fields in client.xrevrange("clawrl:samples", count=4 * REWARD_WINDOW):
        try:
            sample = decode_entry(fields, Sample)
        except RecordError:
            continue
        if any(sample.loss_mask):
            rewards.append(sample.reward)
        if len(rewards) == REWARD_WINDOW:
            break
    state.reward_mean = sum(rewards) / len(rewards) if rewards else None
    shared_found = False
    for _, fields in client.xrevrange("clawrl:weight-syncs", count=1000):
        result = SyncResult.from_fields(fields)
        state.last_sync = state.last_sync or result
        if result.outcome not in ("ok", "skipped"):
            continue
        if result.tenant:  # a tenant's adapter: not the shared policy's version
            state.tenant_versions.setdefault(result.tenant, result.version)
        elif not shared_found:
            state.policy_version, shared_found = result.version, True
    return state
