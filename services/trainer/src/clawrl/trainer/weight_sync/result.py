"""What one sync did (`SyncResult`): published on the results stream, logged in one line, and
the job's exit code."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# Exit codes of `clawrl-weight-sync run`, by outcome.
EXIT_CODES = {"ok": 0, "skipped": 0, "failed": 1, "busy": 2, "inconsistent": 3}


@dataclass
class SyncResult:
    """What one sync did; published on the results stream and logged in one line."""

    version: int
    outcome: str  # ok | skipped | failed | busy | inconsistent
    reason: str = ""
    pause_s: float = 0.0  # user-visible: first Pause sent -> last Resume answered
    drain_s: float = 0.0  # of which waiting for in-flight generations
    load_s: float = 0.0  # slowest engine's load (or the broadcast, and its disk fallback)
    transport: str = "disk"  # how the engines got the weights: disk | nccl
    broadcast_error: str = ""  # why a broadcast fell back to disk
    retracted: int = 0  # generations that went on under the new weights (engines' count)
    gateways: int = 0
    engines: int = 0
    renewal_failures: int = 0
    job_id: str = ""
    finished_at: float = 0.0
    adapter: str = ""  # LoRA syncs: the adapter switched to (no pause; load_s is its load)
    switch_s: float = 0.0  # LoRA syncs: first SwitchAdapter sent -> last answered
    unloaded: int = 0  # LoRA syncs: old adapters unloaded (engine x adapter)
    kept: int = 0  # LoRA syncs: old adapters left loaded (still in use, or unload failed)
    tenant: str = ""  # a tenant's adapter sync (per-tenant mode): whose; "" for the shared policy

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.outcome, 1)

    def fields(self) -> dict[str, str]:
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_fields(cls, entry: dict[bytes | str, bytes | str]) -> SyncResult:
        text = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in entry.items()
        }
        known = {f.name: f.type for f in fields(cls)}
        values = {}
        for key, value in text.items():
            kind = known.get(key)
            if kind is not None:
                values[key] = {"int": int, "float": float}.get(str(kind), str)(value)
        return cls(**values)

    def summary(self) -> str:
        if self.adapter:
            return (
                f"weight sync to v{self.version} (adapter {self.adapter}"
                + (f" of tenant {self.tenant}" if self.tenant else "")
                + f"): {self.outcome}"
                + (f" ({self.reason})" if self.reason else "")
                + f"; no pause; load {self.load_s:.3f}s, switch {self.switch_s:.4f}s"
                + f", {self.unloaded} old adapter(s) unloaded"
                + (f", {self.kept} kept" if self.kept else "")
                + f" over {self.gateways} gateway(s) and {self.engines} engine(s)"
            )
        return (
            f"weight sync to v{self.version}: {self.outcome}"
            + (f" ({self.reason})" if self.reason else "")
            + f"; pause {self.pause_s:.3f}s (drain {self.drain_s:.3f}s, load {self.load_s:.3f}s)"
            + (f", {self.retracted} generation(s) retracted" if self.retracted else "")
            + f" over {self.gateways} gateway(s) and {self.engines} engine(s)"
            + (" by broadcast" if self.transport == "nccl" else "")
        )
