"""One training step, from a collected batch to a durable state, and the loop of steps.

Order of a step (exactly-once rests on it):
1. old log-probs on the current weights (and reference log-probs when kl_coef > 0);
2. advantages (pure), then the optimizer step on the backend;
3. every sync_interval steps: export policy/v{N+1} (staged, then renamed);
4. every state_interval steps, and on every export: save a state (weights, optimizer, step,
   policy version, trained ids) and make it durable;
5. only then XACK the entries of the steps it includes, and announce the new version.
A crash before 4 replays the steps from the last state with the same entries (still pending);
a crash between 4 and 5 finds the ids in the state and acknowledges them without training.
Redis away a moment (a failover) costs a pause, not a crash: a failed read of samples is read
again, and a step's own Redis calls (its unfinished-step counts, acknowledgements, dead letters,
announcements) are made again after a pause, so the backend keeps its model.

In `[tenants] mode = "per_tenant"` a batch is one adapter's (intake, tenants.TenantQueues): the
step trains that adapter alone, every sync_interval steps of it exports it (a tenant's as
policy/tenant-T/vN, announced as `tenant-T-vN` on the tenants' versions stream), and the same
state holds every adapter, so exactly-once is the same for all. A resume re-announces each
tenant's newest version that its stream lacks. `clawrl-trainer tenants reset T` (or `remove
T`) is applied before the next step, or within a read (consumer.block_ms) while no batch is ready
(apply_resets): T's adapter is dropped and its slot freed, the samples waiting for it are
dropped, its served record is deleted, and its version floor makes samples that its old versions
served dropped as they come (all persisted with the state); the release is announced on the
tenants' versions stream, so that the launcher unroutes T from the running gateways (they serve
it the shared policy) and never syncs its old versions. After a reset T starts a new
adapter from the shared policy (its versions go on from the floor); after a remove it trains
the shared policy until a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from redis.asyncio import Redis

from clawrl.common.logs import log_context
from clawrl.common.records import Sample
from clawrl.common.redis_client import REDIS_ERRORS
from clawrl.common.redis_text import text, text_fields
from clawrl.common.served import delete_served_tenant
from clawrl.common.streams import GroupConsumer
from clawrl.common.tenants import SHARED, tenant_adapter, tenant_versions_stream
from clawrl.common.versions import (
    TenantReleased,
    VersionReady,
    adapter_name,
    announce,
    latest,
    newest_per_tenant,
)
from clawrl.trainer.checkpoints import CheckpointStore, TrainedIds, TrainerState, is_adapter_dir
from clawrl.trainer.driver import BackendHandle, BackendLost
from clawrl.trainer.intake import Collected, Intake
from clawrl.trainer.losses import (
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    masked_mean,
    off_policy_figures,
    step_normalized,
)
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import TrainerSettings
from clawrl.trainer.tenants import RESET_ACTIONS, resets_stream, served_version

log = logging.getLogger(__name__)

# Pause before a Redis call is made again after it failed: first, and at most (doubling between).
REDIS_RETRY_S = (1.0, 30.0)

T = TypeVar("T")


@dataclass
class StepReport:
    """What one step did, for the log line, metrics and tests."""

    step: int
    policy_version: int
    sample_ids: tuple[str, ...]
    figures: dict[str, float]
    exported: bool


def batch_figures(
    batch, old_logp: torch.Tensor, advantages: torch.Tensor, policy_version: int, tis_cap: float
) -> dict[str, float]:
    """Reward/advantage statistics, mean |old - rollout|, the behaviour ratio pi_old / pi_rollout
    over trained tokens (mean, max, fraction truncated at `tis_cap`) and the staleness of the
    samples (policy versions behind `policy_version`, mean and max)."""
    mask = batch.loss_mask
    adv_mean = masked_mean(advantages, mask)
    adv_var = masked_mean((advantages - adv_mean).square(), mask)
    staleness = (policy_version - batch.policy_versions).float()
    return {
        "reward_mean": float(batch.reward.mean()),
        "advantage_mean": float(adv_mean),
        "advantage_std": float(adv_var.sqrt()),
        "old_rollout_abs_diff": float(masked_mean((old_logp - batch.rollout_logp).abs(), mask)),
        **off_policy_figures(old_logp, batch.rollout_logp, mask, tis_cap),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
    }


def has_signal(advantages: torch.Tensor, batch, cfg) -> bool:
    """advantages: [B, R] -> whether a step would learn anything from the users: a nonzero
    advantage on a trained token, or a top-K distillation term (distill_coef > 0 and a sample
    with a teacher). KL and entropy terms alone only pull the policy back to where it was."""
    if bool((advantages * batch.loss_mask).abs().gt(0).any()):
        return True
    return bool(cfg.distill_coef) and bool(batch.has_teacher.any())


def without_constant_steps(batch, cfg: AdvantageConfig):
    """step_wise with step_normalize: the batch with the turns of constant (task, turn index)
    buckets taken out of the loss mask (OpenClaw-RL removes those samples: they would still
    weigh in the token mean with a zero advantage), and how many there were; else unchanged."""
    if cfg.estimator != "step_wise" or not cfg.step_normalize or batch.step_group is None:
        return batch, 0
    _, kept = step_normalized(batch.reward, batch.step_group, cfg.eps)
    dropped = int((~kept).sum())
    if not dropped:
        return batch, 0
    mask = batch.loss_mask * kept[:, None].to(batch.loss_mask.dtype)
    return dataclasses.replace(batch, loss_mask=mask), dropped


class VersionSync(Protocol):
    """A weight sync the trainer runs itself once a version is announced (transport nccl:
    `megatron.broadcast_sync.BroadcastSync`); with disk syncs the launcher follows the
    announcements instead."""

    def __call__(self, ready: VersionReady, *, from_disk: bool = False) -> Awaitable[object]: ...


class Trainer:
    """Drives a backend from collected batches to durable states and announced versions."""

    def __init__(
        self,
        settings: TrainerSettings,
        backend: BackendHandle,
        intake: Intake,
        consumer: GroupConsumer,
        store: CheckpointStore,
        redis: Redis,
        metrics: TrainerMetrics,
        sync: VersionSync | None = None,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.intake = intake
        self.consumer = consumer
        self.store = store
        self.redis = redis
        self.metrics = metrics
        self.sync = sync
        self.state = TrainerState()
        self.trained = TrainedIds([], settings.consumer.dedupe_window)
        self.uncommitted: set[str] = set()  # trained in steps not durable yet
        self.pending_acks: list[str] = []  # entries of those steps
        self.unannounced: VersionReady | None = None
        self.unannounced_tenants: list[VersionReady] = []  # tenants' exports, per-tenant mode
        # Set once the trainer is stopping (the service's, from start-up on; else run()'s).
        self._stop = stop or asyncio.Event()
        self._bind_tenants()

    def _bind_tenants(self) -> None:
        """The queues route by the state's tenants (the same dicts: a step or a reset updates
        both)."""
        queues = self.intake.queues
        if queues is None:
            return
        queues.owners = {t for t in self.state.tenant_steps if t != SHARED}
        queues.versions = self.state.tenant_versions
        queues.floors = self.state.tenant_floors
        queues.removed = set(self.state.tenants_removed)

    async def resume(self) -> None:
        """Join the consumer group, load the newest durable state, if any, and re-announce its
        version if needed. Redis away meanwhile (a trainer that starts before it, a failover)
        costs a wait, not a restart that would load the backend again."""
        await self._redis("resume", self.consumer.ensure_group)
        found = self.store.latest_state()
        if found is None:
            log.info("no checkpoint in %s: starting from the base model", self.store.root)
            return
        state, path = found
        await self.backend.call("load_state", path)
        self.state = state
        self.trained = TrainedIds(state.trained_ids, self.settings.consumer.dedupe_window)
        self.metrics.policy_version.set(state.policy_version)
        self.metrics.step.set(state.step)
        for tenant, version in state.tenant_versions.items():  # the dashboard's tenant versions
            self.metrics.tenant_version.labels(tenant).set(version)
        self._bind_tenants()  # the tenants that have an adapter already, their floors
        log.info("resumed from %s: step %d, policy version %d, %d trained ids",
                 path, state.step, state.policy_version, len(state.trained_ids))  # fmt: skip
        if state.policy_version:
            version = state.policy_version
            ready = self._ready(version, self.store.policies / f"v{version}")
            await self._redis("resume", lambda: self._announce_unless_announced(ready))
            if self.sync is not None:
                # The engines may serve an older version; the backend may already hold weights
                # newer than the export (a state saved after it): from disk.
                await self.sync(ready, from_disk=True)
        await self._redis("resume", self._reannounce_tenants)

    async def _announce_unless_announced(self, ready: VersionReady) -> None:
        """Announce the resumed version when the versions stream lacks it (the trainer died
        between the durable state and the announcement)."""
        announced = await latest(self.redis, self.settings.redis.versions_stream)
        if announced is None or announced.version < ready.version:
            await self._announce(ready)

    async def _reannounce_tenants(self) -> None:
        """Announce each tenant's newest version again when its stream lacks it (the trainer
        died between the durable state and the announcement)."""
        if not self.state.tenant_versions:
            return
        stream = tenant_versions_stream(self.settings.redis.versions_stream)
        announced = await newest_per_tenant(self.redis, stream)
        for tenant, version in sorted(self.state.tenant_versions.items()):
            # A version below the floor is of an adapter since reset: never announced again.
            floor = self.state.tenant_floors.get(tenant, 1)
            if version >= floor and announced.get(tenant, 0) < version:
                path = self.store.policies / f"tenant-{tenant}" / f"v{version}"
                await announce(self.redis, stream, self._tenant_ready(tenant, version, path))
                log.info("announced tenant %s's version %d again (its announcement was lost)",
                         tenant, version)  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        """Take steps until `stop` is set; the step in progress finishes and commits first."""
        self._stop = stop
        pause_s = REDIS_RETRY_S[0]
        while not stop.is_set():
            current = self.state.policy_version if self.intake.queues is None else self._version_of
            try:
                collected = await self.intake.next_batch(
                    current, self.trained.__contains__, self.uncommitted, stop,
                    block_ms=self.settings.consumer.block_ms,
                    between_reads=self.apply_resets if self.intake.queues is not None else None,
                )  # fmt: skip
            except REDIS_ERRORS as exc:
                # Redis away a moment (a failover): read again, not restart the backend. The
                # intake kept what it had read.
                pause_s = await self._pause("intake", exc, pause_s)
                continue
            pause_s = REDIS_RETRY_S[0]
            if collected is None:
                break
            await self.step(collected)
        if self.pending_acks:
            await self.commit()

    async def _pause(self, stage: str, exc: Exception, pause_s: float) -> float:
        """Count and log a failed Redis call, wait `pause_s` (less if the trainer stops);
        -> the pause before the next try."""
        self.metrics.redis_errors.labels(stage).inc()
        log.warning("a Redis call (%s) failed, again in %.0f s: %s: %s",
                    stage, pause_s, type(exc).__name__, exc)  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), pause_s)
        return min(2 * pause_s, REDIS_RETRY_S[1])

    async def _redis(self, stage: str, call: Callable[[], Awaitable[T]]) -> T:
        """A step's own Redis call, made again after a pause until Redis answers (a failover,
        a cluster client rebuilding its slot map), so the backend keeps its model. Once the
        trainer is stopping the error goes up: the restart replays from the last durable
        state, as after a crash. Each call here is safe to repeat, up to a rare duplicate
        when Redis ran a call whose answer was lost (an entry's unfinished count one higher,
        a dead letter or an announcement twice)."""
        pause_s = REDIS_RETRY_S[0]
        while True:
            try:
                return await call()
            except REDIS_ERRORS as exc:
                if self._stop.is_set():
                    self.metrics.redis_errors.labels(stage).inc()
                    raise
                pause_s = await self._pause(stage, exc, pause_s)

    async def step(self, collected: Collected) -> StepReport | None:
        """Train one collected batch; None when the backend could not train it (its entries
        are then dead-lettered with the error, and the stream goes on)."""
        started = time.perf_counter()
        per_tenant = self.intake.queues is not None
        adapter = collected.tenant
        version_at_start = self._current(adapter)
        batch = collate([h.sample for h in collected.held])
        entry_ids = [h.entry.entry_id for h in collected.held]
        # Counted before the backend sees the batch: if it kills the backend (or the whole
        # trainer), the restart knows, and splits the batch instead of dying on it forever.
        unfinished = self.intake.unfinished
        await self._redis("step", lambda: unfinished.begin(entry_ids))
        try:
            if per_tenant:
                await self.backend.call("use_adapter", adapter)
            figures = await self._optimize(batch, version_at_start)
        except BackendLost as exc:
            # No model left: restart from the last state (the entries stay pending).
            log.error("the backend was lost on step %d with %d samples (%s): %s",
                      self.state.step + 1, len(entry_ids), ", ".join(batch.sample_ids),
                      exc)  # fmt: skip
            raise
        except Exception as exc:  # one batch the backend cannot train must not stop the stream
            await self._redis("step", lambda: unfinished.finish(entry_ids))
            await self._reject(collected, exc)
            return None
        await self._redis("step", lambda: unfinished.finish(entry_ids))
        if figures is None:
            await self._skip(collected, batch)
            return None
        self.state.step += 1
        self.state.samples_trained += batch.size
        self.uncommitted.update(batch.sample_ids)
        self.pending_acks += [h.entry.entry_id for h in collected.held] + collected.ack_with_step

        exported = self.state.step % self.settings.checkpoint.sync_interval == 0
        if per_tenant:  # each adapter exports every sync_interval steps of its own
            adapter_steps = self.state.tenant_steps.get(adapter, 0) + 1
            self.state.tenant_steps[adapter] = adapter_steps
            exported = adapter_steps % self.settings.checkpoint.sync_interval == 0
            self.metrics.record_tenant_step(adapter, batch.size, figures)
        try:
            if exported:
                export_started = time.perf_counter()
                if adapter == SHARED:
                    await self.export(self.state.policy_version + 1)
                else:
                    await self.export_tenant(adapter)
                figures["export_s"] = time.perf_counter() - export_started
            if exported or self.state.step % self.settings.checkpoint.state_interval == 0:
                commit_started = time.perf_counter()
                await self.commit()
                figures["checkpoint_s"] = time.perf_counter() - commit_started
        except BackendLost:
            raise
        except Exception:
            # Not durable: stop, and let the restart replay from the last state.
            self.metrics.checkpoint_failures.inc()
            log.exception("could not write the checkpoint of step %d", self.state.step)
            raise
        figures["step_s"] = time.perf_counter() - started
        tokens = int(batch.lengths.sum())
        figures["tokens_per_second"] = tokens / figures["step_s"]
        self._observe(collected, batch, figures, tokens, version_at_start)
        return StepReport(self.state.step, self._current(adapter), batch.sample_ids, figures,
                          exported)  # fmt: skip

    def _current(self, adapter: str) -> int:
        """The version an adapter's samples are measured against (SHARED: the policy's)."""
        if adapter == SHARED:
            return self.state.policy_version
        return self.state.tenant_versions.get(adapter, 0)

    def _version_of(self, sample: Sample) -> int:
        """Per-tenant mode: the version of the adapter that served `sample` (its tenant's own,
        or the shared policy's), which its policy_version counts in."""
        if served_version(sample.tenant, sample.weight_version) is None:
            return self.state.policy_version
        return self._current(sample.tenant)

    async def _optimize(self, batch, version: int) -> dict[str, float] | None:
        """Old (and reference) log-probs, advantages, one optimizer step -> the step's figures;
        None (no step) when the batch carries no learning signal (`has_signal`)."""
        started = time.perf_counter()
        cfg = self.settings.ppo.loss_config()
        old_logp = await self.backend.call("compute_logprobs", batch, "policy")
        ref_logp = None
        if cfg.kl_coef:
            ref_logp = await self.backend.call("compute_logprobs", batch, "reference")
        logprobs_s = time.perf_counter() - started
        adv_cfg = self.settings.advantage_config()
        batch, dropped = without_constant_steps(batch, adv_cfg)
        advantages = compute_advantages(
            AdvantageInputs(
                reward=batch.reward, old_logp=old_logp, teacher_logp=batch.teacher_logp,
                has_teacher=batch.has_teacher, mask=batch.loss_mask,
                group_index=batch.group_index, step_group=batch.step_group,
            ),
            adv_cfg,
        )  # fmt: skip
        if not has_signal(advantages, batch, cfg):
            return None
        cap = cfg.tis_cap if cfg.off_policy_correction == "tis" else math.inf  # "none": no cap
        figures = batch_figures(batch, old_logp, advantages, version, cap)
        if adv_cfg.estimator == "step_wise":
            figures["step_wise_dropped"] = float(dropped)
        figures |= await self.backend.call(
            "train_step", batch.with_targets(old_logp, advantages, ref_logp), cfg
        )
        figures["logprobs_s"] = logprobs_s
        return figures

    async def _skip(self, collected: Collected, batch) -> None:
        """A batch with no learning signal takes no step and makes no version: its entries are
        acknowledged (nothing in them can train, now or on a replay) and counted."""
        self.metrics.batches_skipped.labels("no_signal").inc()
        self.metrics.samples_consumed.labels("dropped").inc(batch.size)
        self.metrics.samples_dropped.labels("no_signal").inc(batch.size)
        log.warning("no step on %d samples: every advantage is 0 (reward mean %.3f; e.g. every "
                    "reward 0, or all alike under the batch baseline) and no distillation term",
                    batch.size, float(batch.reward.mean()))  # fmt: skip
        entry_ids = [h.entry.entry_id for h in collected.held] + collected.ack_with_step
        await self._redis("drop", lambda: self.consumer.ack(*entry_ids))

    async def _reject(self, collected: Collected, exc: Exception) -> None:
        """Dead-letter a batch the backend failed on, with the error, and count it."""
        reason = f"training step failed: {type(exc).__name__}: {exc}"
        log.error("step %d failed on %d samples: %s", self.state.step + 1,
                  len(collected.held), reason, exc_info=exc)  # fmt: skip
        self.metrics.step_failures.inc()
        for held in collected.held:
            await self._redis("drop", lambda h=held: self.consumer.dead_letter(h.entry, reason))
        self.metrics.samples_consumed.labels("dropped").inc(len(collected.held))
        self.metrics.samples_dropped.labels("step_failed").inc(len(collected.held))
        # Duplicates held for this step: their originals were trained before, so they go too.
        self.pending_acks += collected.ack_with_step

    async def export(self, version: int) -> None:
        """Write policy/v{version}; it is announced once the state that includes it commits."""
        tmp = self.store.staging(f"v{version}")
        await self.backend.call("export_hf", tmp)
        stream = self.settings.redis.versions_stream
        announced = await self._redis("export", lambda: latest(self.redis, stream))
        path = self.store.commit_export(
            tmp, version, announced=announced.version if announced else None
        )
        self.state.policy_version = version
        self.unannounced = self._ready(version, path)

    async def export_tenant(self, tenant: str) -> None:
        """Write the next version of `tenant`'s adapter (the one in use); it is announced once
        the state that includes it commits."""
        version = self.state.tenant_versions.get(tenant, 0) + 1
        tmp = self.store.staging(f"tenant-{tenant}-v{version}")
        await self.backend.call("export_hf", tmp)
        path = self.store.commit_tenant_export(tmp, tenant, version)
        self.state.tenant_versions[tenant] = version
        self.metrics.tenant_version.labels(tenant).set(version)
        self.unannounced_tenants.append(self._tenant_ready(tenant, version, path))

    def _tenant_ready(self, tenant: str, version: int, path) -> VersionReady:
        return VersionReady(
            version=version,
            path=self.store.announced_path(path),
            step=self.state.step,
            created_at=time.time(),
            adapter=tenant_adapter(tenant, version),
            tenant=tenant,
        )

    async def apply_resets(self) -> None:
        """Apply the resets and removes `clawrl-trainer tenants` asked for since the last applied
        request (see the module docstring), then commit the state that records them."""
        stream = resets_stream(self.settings.redis.versions_stream)
        reply = await self.redis.xread({stream: self.state.resets_applied}, count=100)
        if not reply:
            return
        for entry_id, fields in reply[0][1]:
            self.state.resets_applied = text(entry_id)
            request = text_fields(fields)
            tenant, action = request.get("tenant", ""), request.get("action", "reset")
            if not tenant or tenant == SHARED or action not in RESET_ACTIONS:
                self.metrics.tenant_resets.labels("malformed").inc()
                log.error("tenants request %s is malformed: %r", entry_id, fields)
                continue
            removed = set(self.state.tenants_removed)
            has_adapter = tenant in self.state.tenant_steps or tenant in self.intake.queues.owners
            if action == "reset" and not has_adapter and tenant not in removed:
                self.metrics.tenant_resets.labels("no_adapter").inc()
                log.warning("reset of tenant %s requested: it has no adapter of its own (it "
                            "trains the shared policy already)", tenant)  # fmt: skip
                continue
            await self._release(tenant, action)
            if action == "remove":
                removed.add(tenant)
            else:
                removed.discard(tenant)  # a reset lets a removed tenant have an adapter again
            self.state.tenants_removed = sorted(removed)
            self.intake.queues.removed = removed
            outcome = "removed" if action == "remove" else "reset"
            self.metrics.tenant_resets.labels(outcome).inc()
            log.warning("%s tenant %s: its adapter is dropped, its samples up to version %d "
                        "with it; it is served the shared policy", outcome, tenant,
                        self.state.tenant_floors[tenant] - 1)  # fmt: skip
        await self.commit()

    async def _release(self, tenant: str, action: str) -> None:
        """Drop `tenant`'s adapter (backend, slot, waiting samples, served record), raise its
        version floor past every version it exported, and announce the release."""
        await self.backend.call("remove_adapter", tenant)
        self.state.tenant_steps.pop(tenant, None)
        floor = self.state.tenant_versions.get(tenant, 0) + 1
        self.state.tenant_floors[tenant] = floor
        dropped = await self.intake.release_tenant(tenant)
        # Gateways that start, and the launcher, stop routing the tenant to its old adapter.
        await delete_served_tenant(self.redis, self.settings.sync.served_key, tenant)
        # Running gateways too: the launcher unroutes it on each. Announced before the state
        # commits: a crash before that applies the request again, with the same floor.
        stream = tenant_versions_stream(self.settings.redis.versions_stream)
        await announce(self.redis, stream, TenantReleased(tenant, floor, action, time.time()))
        if dropped:
            log.warning("dropped %d samples waiting for tenant %s's adapter", dropped, tenant)

    async def commit(self) -> None:
        """Make a state durable, then acknowledge its entries and announce its version."""
        self.trained.extend(sorted(self.uncommitted))
        self.state.trained_ids = self.trained.as_list()
        tmp = self.store.staging(f"step-{self.state.step:08d}")
        await self.backend.call("save_state", tmp)
        self.store.commit_state(tmp, self.state)
        # Durable: from here a crash finds these ids in the state and never trains them again.
        if self.state.step == self.settings.checkpoint.hold_before_ack_step:
            log.warning("holding before XACK of step %d (fault injection)", self.state.step)
            await asyncio.Event().wait()
        acks = self.pending_acks
        await self._redis("commit", lambda: self.consumer.ack(*acks))
        self.pending_acks = []
        self.uncommitted = set()
        if self.unannounced is not None:
            ready = self.unannounced
            await self._redis("announce", lambda: self._announce(ready))
            self.unannounced = None
            if self.sync is not None:
                # Before the next step changes the weights: they are exactly version N now.
                await self.sync(ready)
        tenants_stream = tenant_versions_stream(self.settings.redis.versions_stream)
        for ready in self.unannounced_tenants:
            await self._redis("announce", lambda r=ready: announce(self.redis, tenants_stream, r))
            log.info("announced tenant %s's version %d at %s", ready.tenant, ready.version,
                     ready.path)  # fmt: skip
        self.unannounced_tenants = []

    def _ready(self, version: int, path) -> VersionReady:
        # What the backend wrote decides how engines load it: a LoRA adapter, or full weights.
        adapter = adapter_name(version) if is_adapter_dir(path) else ""
        return VersionReady(version=version, path=self.store.announced_path(path),
                            step=self.state.step, created_at=time.time(),
                            adapter=adapter)  # fmt: skip

    async def _announce(self, ready: VersionReady) -> None:
        await announce(self.redis, self.settings.redis.versions_stream, ready)
        log.info("announced policy version %d at %s", ready.version, ready.path)

    def _observe(
        self, collected: Collected, batch, figures: dict[str, float], tokens: int, version: int
    ) -> None:
        m = self.metrics
        now = time.time()
        m.steps.inc()
        m.step.set(self.state.step)
        m.policy_version.set(self.state.policy_version)
        m.tokens.inc(tokens)
        m.samples_consumed.labels("trained").inc(batch.size)
        for held in collected.held:
            m.sample_latency.observe(max(0.0, now - held.xadd_time_s))
            m.staleness.observe(version - held.sample.policy_version)
        for phase in ("logprobs", "forward_backward", "optimizer", "checkpoint", "export", "step"):
            if f"{phase}_s" in figures:
                m.step_seconds.labels("total" if phase == "step" else phase).observe(
                    figures[f"{phase}_s"]
                )
        m.record_step(figures)
        with log_context(policy_version=self.state.policy_version):
            log.info(
                "step %d: %d samples, %d tokens, staleness %.2f (max %d), loss %.4f, "
                "reward %.3f, adv %.3f±%.3f, ratio %.4f (max %.3f, tis-clipped %.3f), "
                "clip %.3f, entropy %.3f, kl %.4f, |old-rollout| %.5f, "
                "grad %.3f, %.1f tok/s, %.2fs (logp %.2fs, fwd/bwd %.2fs, opt %.2fs)",
                self.state.step, batch.size, tokens, figures["staleness_mean"],
                figures["staleness_max"], figures.get("loss", 0.0),
                figures["reward_mean"], figures["advantage_mean"], figures["advantage_std"],
                figures["ratio_mean"], figures["ratio_max"], figures["tis_clip_frac"],
                figures.get("clip_frac", 0.0), figures.get("entropy", 0.0),
                figures.get("kl_ref", 0.0), figures["old_rollout_abs_diff"],
                figures.get("grad_norm", 0.0), figures["tokens_per_second"], figures["step_s"],
                figures["logprobs_s"], figures.get("forward_backward_s", 0.0),
                figures.get("optimizer_s", 0.0),
                # Per-tenant mode: the adapter the step trained (shared: the shared policy's).
                extra={"adapter": collected.tenant or "shared"} if self.intake.queues else None,
            )  # fmt: skip
