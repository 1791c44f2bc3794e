"""Checkpoint layout: atomic commits, the LATEST pointer, pruning, the bounded trained-id window."""

from pathlib import Path

import pytest

from clawrl.trainer.checkpoints import CheckpointStore, TrainedIds, TrainerState
from clawrl.trainer.settings import CheckpointSettings


def store(tmp_path: Path, **kwargs) -> CheckpointStore:
    return CheckpointStore(CheckpointSettings(dir=tmp_path, **kwargs))


def test_states_commit_atomically_and_the_newest_wins(tmp_path: Path) -> None:
    s = store(tmp_path, keep_states=2)
    assert s.latest_state() is None
    for step in (1, 2, 3):
        staged = s.staging(f"step-{step:08d}")
        (staged / "backend.pt").write_bytes(b"weights")
        s.commit_state(staged, TrainerState(step=step, policy_version=step, trained_ids=["a:0"]))
    state, path = s.latest_state()
    assert (state.step, state.policy_version, state.trained_ids) == (3, 3, ["a:0"])
    assert path.name == "step-00000003" and (path / "backend.pt").read_bytes() == b"weights"
    assert sorted(p.name for p in (tmp_path / "state").iterdir() if p.is_dir()) == [
        "step-00000002",
        "step-00000003",
    ]
    assert not list(tmp_path.glob(".tmp-*"))  # nothing staged is left behind


def test_a_crashed_staging_never_shows_and_is_cleared(tmp_path: Path) -> None:
    s = store(tmp_path)
    staged = s.staging("v1")
    (staged / "half-written").write_text("x")
    assert not (tmp_path / "policy" / "v1").exists()  # invisible until renamed
    again = s.staging("v1")  # the next attempt starts clean
    assert list(again.iterdir()) == []


def test_exports_keep_the_last_versions_and_replace_uncommitted_ones(tmp_path: Path) -> None:
    s = store(tmp_path, keep_versions=2)
    for version in (1, 2, 3):
        staged = s.staging(f"v{version}")
        (staged / "model.safetensors").write_text(f"v{version}")
        s.commit_export(staged, version, announced=None)  # nothing announced: keep decides
    assert sorted(p.name for p in (tmp_path / "policy").iterdir()) == ["v2", "v3"]
    # v3 again (its state never committed before a crash): the new one replaces it
    staged = s.staging("v3")
    (staged / "model.safetensors").write_text("v3 again")
    final = s.commit_export(staged, 3, announced=None)
    assert (final / "model.safetensors").read_text() == "v3 again"


def export(s: CheckpointStore, version: int, announced: int | None) -> None:
    staged = s.staging(f"v{version}")
    (staged / "adapter_model.safetensors").write_text(f"v{version}")
    s.commit_export(staged, version, announced=announced)


def versions_on_disk(tmp_path: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in (tmp_path / "policy").iterdir())


def test_the_announced_version_and_the_one_before_it_are_never_pruned(tmp_path: Path) -> None:
    # Exports ran ahead of the announcements (v3 still announced while v4..v6 were written, as
    # after a resume or a slow announce): engines serve v3, a failed sync rolls back to v2.
    s = store(tmp_path, keep_versions=1)
    for version in (1, 2, 3):
        export(s, version, announced=version - 1 or None)
    for version in (4, 5, 6):
        export(s, version, announced=3)
    assert versions_on_disk(tmp_path) == [2, 3, 6]
    export(s, 7, announced=6)  # announced moved on: v2 and v3 may go (v5 went at v6)
    assert versions_on_disk(tmp_path) == [6, 7]


def test_every_version_still_trainable_stays_on_disk() -> None:
    # Samples up to max_staleness versions old are trained, so their versions may still be
    # served or rolled back to: the default config keeps them, a smaller keep is refused.
    from pydantic import ValidationError

    from clawrl.trainer.settings import TrainerSettings

    settings = TrainerSettings()
    assert settings.checkpoint.keep_versions >= settings.rollout.max_staleness + 1
    with pytest.raises(ValidationError, match=r"keep_versions \(4\) must be at least"):
        TrainerSettings(checkpoint={"keep_versions": 4}, rollout={"max_staleness": 4})
    TrainerSettings(checkpoint={"keep_versions": 2}, rollout={"max_staleness": 1})


def test_announced_paths_follow_the_engines_mount(tmp_path: Path) -> None:
    s = store(tmp_path, export_path_prefix="/mnt/checkpoints")
    assert s.announced_path(tmp_path / "policy" / "v4") == "/mnt/checkpoints/policy/v4"
    assert store(tmp_path).announced_path(tmp_path / "policy") == str(tmp_path / "policy")


def test_trained_ids_forget_the_oldest_past_the_window() -> None:
    ids = TrainedIds(["a", "b"], window=3)
    ids.extend(["c", "b", "d"])
    assert ids.as_list() == ["b", "c", "d"]
    assert "a" not in ids and "d" in ids
