"""The weight sync the trainer runs itself when `weight_sync.transport = nccl`.

Right after an export is durable and announced, the trainer runs the weight-sync job's protocol
in its own process (`weight_sync.job.sync_version`: the lock, every gateway paused under a
renewed lease, rollback, resume with N) with the load step replaced by a broadcast from the
backend's rank 0, which holds the weights. It runs between two steps, so what is broadcast is
exactly the export of version N. The export on disk stays the fallback: when the broadcast
fails, the engines load N from disk. The group is formed at the first broadcast and kept; it is
formed again when the engines change and after a failed broadcast.
"""

from __future__ import annotations

import logging
import secrets

from redis.asyncio import Redis

from clawrl.common.versions import VersionReady
from clawrl.trainer.driver import BackendHandle
from clawrl.trainer.megatron.nccl_sync import Engine
from clawrl.trainer.settings import TrainerSettings
from clawrl.trainer.weight_sync.job import SyncResult, sync_version
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics

log = logging.getLogger(__name__)


class BroadcastFailed(RuntimeError):
    """The broadcast did not complete (the sync falls back to disk)."""


class BroadcastSync:
    """`await sync(ready)`: one sync of `ready` to every engine, by broadcast (else from disk)."""

    def __init__(
        self,
        settings: TrainerSettings,
        backend: BackendHandle,
        redis: Redis,
        metrics: WeightSyncMetrics,
    ) -> None:
        self.job_settings = settings.sync_job_settings()
        self.transport = settings.weight_sync
        self.backend = backend
        self.redis = redis
        self.metrics = metrics
        self.connected: list[str] | None = None  # engine URLs of the group formed

    async def __call__(self, ready: VersionReady, *, from_disk: bool = False) -> SyncResult | None:
        """Sync `ready` (from disk only with `from_disk`: the backend may hold newer weights,
        e.g. at resume); None when the sync itself broke (logged; the next version retries)."""
        job_id = f"trainer-v{ready.version}-{secrets.token_hex(3)}"
        try:
            result = await sync_version(
                self.job_settings, self.redis, ready, job_id,
                broadcast=None if from_disk else self.broadcast,
            )  # fmt: skip
        except Exception:  # training goes on; the engines keep the version they serve
            log.exception("the weight sync to v%d broke", ready.version)
            self.metrics.syncs.labels(outcome="crashed").inc()
            return None
        self.metrics.observe(result)
        return result

    async def broadcast(self, ready: VersionReady, urls: list[str]) -> None:
        """The sync's load step: (re)form the group with these engines, send every tensor."""
        try:
            if self.connected != urls:
                self.connected = None
                t = self.transport
                engines = [Engine(url, t.engine_tp) for url in urls]
                # A fresh name each time: an engine keeps the groups it joined, and a name it
                # already holds cannot be created again. Rank 0 leaves its old group first.
                group = f"{t.group_name}-{secrets.token_hex(3)}"
                await self.backend.call(
                    "connect_engines", engines, t.master_address, t.master_port, group,
                    t.bucket_mb << 20, t.timeout_s,
                )  # fmt: skip
                self.connected = list(urls)
            buckets = await self.backend.call("broadcast_weights", ready.version)
        except BaseException as exc:
            self.connected = None  # a group that failed once may be wedged: form a new one
            if isinstance(exc, Exception):  # the rank's own error, without Ray's traceback
                cause = getattr(exc, "cause", None) or exc
                raise BroadcastFailed(f"{type(cause).__name__}: {cause}") from exc
            raise
        log.info("broadcast v%d to %d engine(s) in %d bucket(s)", ready.version, len(urls),
                 buckets)  # fmt: skip
