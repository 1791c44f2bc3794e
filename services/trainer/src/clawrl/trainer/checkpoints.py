"""Checkpoints on the shared volume: resumable states and the HF exports the engines load.

    {dir}/state/step-000012/   backend.pt (weights, optimizer, RNG) + trainer.json (TrainerState)
    {dir}/state/LATEST         the name of the newest complete state
    {dir}/policy/v3/           HF safetensors + config + tokenizer of policy version 3
                               (with LoRA: the PEFT adapter, adapter_config.json + safetensors)
    {dir}/policy/tenant-T/v2/  version 2 of tenant T's adapter (tenants.mode = per_tenant)

Everything is written into a `.tmp-*` sibling, flushed to disk, then renamed: a reader (the
trainer after a crash, an engine loading v3) sees a whole directory or none. A state is durable
once LATEST names it; only then are its samples acknowledged on the stream.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import deque
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clawrl.trainer.settings import CheckpointSettings

log = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """What the driver resumes besides the backend's weights and optimizer."""

    step: int = 0
    policy_version: int = 0
    samples_trained: int = 0
    # Ids of the last trained samples (oldest first), bounded by the dedupe window.
    trained_ids: list[str] = field(default_factory=list)
    # Per-tenant mode: each tenant's steps and last exported adapter version.
    tenant_steps: dict[str, int] = field(default_factory=dict)
    tenant_versions: dict[str, int] = field(default_factory=dict)
    # The last entry of the tenants' resets stream applied (`clawrl-trainer tenants reset`).
    resets_applied: str = "0-0"
    # Per tenant reset or removed: the first version of its next adapter (samples its older
    # versions served are dropped); the tenants removed (no adapter until a reset).
    tenant_floors: dict[str, int] = field(default_factory=dict)
    tenants_removed: list[str] = field(default_factory=list)


class TrainedIds:
    """Sample ids already trained: a bounded window, oldest forgotten first."""

    def __init__(self, ids: list[str], window: int) -> None:
        self._order: deque[str] = deque(maxlen=window)
        self._set: set[str] = set()
        self.extend(ids)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._set

    def extend(self, ids: list[str]) -> None:
        for sample_id in ids:
            if sample_id in self._set:
                continue
            if len(self._order) == self._order.maxlen:
                self._set.discard(self._order[0])
            self._order.append(sample_id)
            self._set.add(sample_id)

    def as_list(self) -> list[str]:
        return list(self._order)


def is_adapter_dir(path: Path) -> bool:
    """A PEFT adapter directory (LoRA export), rather than a full HF model."""
    return (Path(path) / "adapter_config.json").is_file()


def fsync_tree(path: Path) -> None:
    """Flush every file under `path`, then the directories, to disk."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """Layout and atomic commits of states and exports (see the module docstring)."""

    def __init__(self, settings: CheckpointSettings) -> None:
        self.settings = settings
        self.root = Path(settings.dir)
        self.states = self.root / "state"
        self.policies = self.root / "policy"
        self.states.mkdir(parents=True, exist_ok=True)
        self.policies.mkdir(parents=True, exist_ok=True)

    # --- states ----------------------------------------------------------------------------------

    def latest_state(self) -> tuple[TrainerState, Path] | None:
        """The newest durable state and its directory, None before the first one."""
        pointer = self.states / "LATEST"
        if not pointer.is_file():
            return None
        path = self.states / pointer.read_text().strip()
        state = TrainerState(**json.loads((path / "trainer.json").read_text()))
        return state, path

    def staging(self, name: str) -> Path:
        """An empty temporary directory to write `name` into (left-overs of a crash removed)."""
        tmp = self.root / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit_state(self, tmp: Path, state: TrainerState) -> Path:
        """Add trainer.json to the staged state, make it durable and the latest; prune."""
        (tmp / "trainer.json").write_text(json.dumps(asdict(state)))
        final = self.states / f"step-{state.step:08d}"
        self._replace(tmp, final)
        pointer_tmp = self.states / "LATEST.tmp"
        pointer_tmp.write_text(final.name)
        with open(pointer_tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(pointer_tmp, self.states / "LATEST")
        _fsync_dir(self.states)
        self._prune(self.states, "step-", self.settings.keep_states)
        return final

    # --- exports ---------------------------------------------------------------------------------

    def commit_export(self, tmp: Path, version: int, *, announced: int | None) -> Path:
        """Make the staged directory policy/v{version}; keep the last `keep_versions`, and never
        prune the `announced` version nor the one before it: engines serve them (or are still
        loading them) until the sync of the new version is done, and a failed sync rolls back."""
        final = self.policies / f"v{version}"
        self._replace(tmp, final)
        spare = set() if announced is None else {announced, announced - 1}
        self._prune(self.policies, "v", self.settings.keep_versions, spare)
        return final

    def commit_tenant_export(self, tmp: Path, tenant: str, version: int) -> Path:
        """Make the staged adapter policy/tenant-{tenant}/v{version}; keep the last
        `keep_versions` of the tenant's."""
        parent = self.policies / f"tenant-{tenant}"
        parent.mkdir(exist_ok=True)
        final = parent / f"v{version}"
        self._replace(tmp, final)
        self._prune(parent, "v", self.settings.keep_versions)
        return final

    def announced_path(self, path: Path) -> str:
        """`path` as the engines see the volume (export_path_prefix)."""
        prefix = self.settings.export_path_prefix
        if prefix is None:
            return str(path.resolve())
        return str(Path(prefix) / path.relative_to(self.root))

    # --- helpers ---------------------------------------------------------------------------------

    def _replace(self, tmp: Path, final: Path) -> None:
        fsync_tree(tmp)
        if final.exists():
            # Left by a run that crashed before its state committed: never announced, redo it.
            log.warning("replacing %s, written by a step that was not committed", final)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)

    @staticmethod
    def _prune(parent: Path, prefix: str, keep: int, spare: Collection[int] = ()) -> None:
        def number(p: Path) -> int:
            return int(p.name[len(prefix) :])

        entries = sorted(
            (p for p in parent.iterdir() if p.is_dir() and p.name.startswith(prefix)
             and p.name[len(prefix):].isdigit()),
            key=number,
        )  # fmt: skip
        for old in entries[:-keep]:
            if number(old) not in spare:
                shutil.rmtree(old, ignore_errors=True)
