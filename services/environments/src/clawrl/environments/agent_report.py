"""Success rates of played episodes: per policy version (the held-out evaluation) and per task
family (the base rate), as pure aggregations, tables, CSV files and PNG plots.

An episode counts for a version only when every reply in it came from that version (a sync in
the middle of an episode splits it: it belongs to neither), and one that broke off (the
gateway or the sandbox failed: no checker verdict) counts for nothing but its error count.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from clawrl.environments.episode import EpisodeResult


@dataclass(frozen=True)
class VersionRate:
    """One version's held-out figures from one evaluation."""

    version: int
    episodes: int  # checked episodes played whole by this version
    passed: int
    complete: bool  # it played every task of the evaluation (comparable with other versions)
    elapsed_s: float | None = None  # since the runner started (make run), when known

    @property
    def rate(self) -> float:
        return self.passed / self.episodes if self.episodes else 0.0


@dataclass(frozen=True)
class FamilyRate:
    """One family's figures over the attempts at its tasks of one split."""

    split: str
    family: str
    tasks: int
    attempts: int  # episodes checked (broken-off ones are counted in errors instead)
    passed: int
    errors: int

    @property
    def rate(self) -> float:
        return self.passed / self.attempts if self.attempts else 0.0


def version_rates(
    results: Iterable[EpisodeResult], tasks: int, elapsed_s: float | None = None
) -> list[VersionRate]:
    """Per version, the checked episodes it played whole; `complete` when they cover `tasks`
    episodes (each held-out task once), by version."""
    played: dict[int, list[bool]] = defaultdict(list)
    for result in results:
        if result.passed is not None and result.policy_version is not None:
            played[result.policy_version].append(result.passed)
    return [
        VersionRate(v, len(p), sum(p), len(p) == tasks, elapsed_s)
        for v, p in sorted(played.items())
    ]


def family_rates(results: Iterable[EpisodeResult]) -> list[FamilyRate]:
    """Per (split, family): distinct tasks, checked attempts, passes, broken-off episodes."""
    tasks: dict[tuple[str, str], set[str]] = defaultdict(set)
    checked: dict[tuple[str, str], list[bool]] = defaultdict(list)
    errors: dict[tuple[str, str], int] = defaultdict(int)
    for result in results:
        key = (result.split, result.family)
        tasks[key].add(result.task_id)
        if result.passed is None:
            errors[key] += 1
        else:
            checked[key].append(result.passed)
    return [
        FamilyRate(
            split,
            family,
            len(tasks[(split, family)]),
            len(checked[(split, family)]),
            sum(checked[(split, family)]),
            errors[(split, family)],
        )
        for split, family in sorted(tasks)
    ]


def split_totals(rates: Sequence[FamilyRate]) -> list[FamilyRate]:
    """One row per split summing its families (family "all")."""
    by_split: dict[str, list[FamilyRate]] = defaultdict(list)
    for rate in rates:
        by_split[rate.split].append(rate)
    return [
        FamilyRate(
            split,
            "all",
            sum(r.tasks for r in rows),
            sum(r.attempts for r in rows),
            sum(r.passed for r in rows),
            sum(r.errors for r in rows),
        )
        for split, rows in sorted(by_split.items())
    ]


# --- held-out per version -----------------------------------------------------------------------

VERSION_COLUMNS = ["policy_version", "episodes", "passed", "success_rate", "complete", "elapsed_s"]


def read_versions(path: Path) -> list[VersionRate]:
    """The rows of a held-out CSV written by write_versions ([] when there is none)."""
    if not path.is_file():
        return []
    with path.open(newline="") as source:
        return [
            VersionRate(
                int(row["policy_version"]),
                int(row["episodes"]),
                int(row["passed"]),
                row["complete"] == "1",
                float(row["elapsed_s"]) if row["elapsed_s"] else None,
            )
            for row in csv.DictReader(source)
        ]


def merge_versions(old: Sequence[VersionRate], new: Sequence[VersionRate]) -> list[VersionRate]:
    """Every version once, by version: a new complete measurement replaces an old one, a
    partial one (split by a sync) never replaces a complete one."""
    merged = {rate.version: rate for rate in old}
    for rate in new:
        kept = merged.get(rate.version)
        if kept is None or rate.complete or not kept.complete:
            merged[rate.version] = rate
    return [merged[v] for v in sorted(merged)]


def write_versions(rates: Sequence[VersionRate], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(VERSION_COLUMNS)
        for r in rates:
            elapsed = "" if r.elapsed_s is None else f"{r.elapsed_s:.1f}"
            writer.writerow(
                [r.version, r.episodes, r.passed, f"{r.rate:.4f}", int(r.complete), elapsed]
            )


def versions_table(rates: Sequence[VersionRate]) -> str:
    lines = [f"{'version':>7}  {'episodes':>8}  {'passed':>6}  {'success':>7}  complete"]
    for r in rates:
        lines.append(
            f"{r.version:>7}  {r.episodes:>8}  {r.passed:>6}  {r.rate:>7.3f}  "
            f"{'yes' if r.complete else 'no (split by a sync)'}"
        )
    return "\n".join(lines)


def _axes(width: float = 7.0):
    """A figure and its axes, drawn for a file only (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, 4))


def _save(fig, ax, path: Path, title: str, ylabel: str, legend: str = "best") -> None:
    import matplotlib.pyplot as plt

    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc=legend)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_versions(rates: Sequence[VersionRate], path: Path, title: str) -> None:
    """Held-out success rate by version (complete evaluations only)."""
    complete = [r for r in rates if r.complete]
    fig, ax = _axes()
    ax.plot(
        [r.version for r in complete],
        [r.rate for r in complete],
        "^-",
        label="held-out success rate (greedy, never trained)",
    )
    ax.set_xlabel("policy version")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xticks([r.version for r in complete])
    _save(fig, ax, path, title, "tasks solved", "lower right")


# --- base rate per family ------------------------------------------------------------------------

FAMILY_COLUMNS = ["split", "family", "tasks", "attempts", "passed", "success_rate", "errors"]


def write_families(rates: Sequence[FamilyRate], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(FAMILY_COLUMNS)
        for r in rates:
            writer.writerow(
                [r.split, r.family, r.tasks, r.attempts, r.passed, f"{r.rate:.4f}", r.errors]
            )


def families_table(rates: Sequence[FamilyRate]) -> str:
    """A markdown table (it goes into the docs as is)."""
    lines = [
        "| split | family | tasks | attempts | passed | success rate | errors |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rates:
        lines.append(
            f"| {r.split} | {r.family} | {r.tasks} | {r.attempts} | {r.passed} | "
            f"{r.rate:.2f} | {r.errors} |"
        )
    return "\n".join(lines)


def plot_families(rates: Sequence[FamilyRate], path: Path, title: str) -> None:
    """Success rate per family, one bar per split."""
    families = sorted({r.family for r in rates})
    splits = sorted({r.split for r in rates})
    width = 0.8 / max(1, len(splits))
    fig, ax = _axes(max(7.0, 0.6 * len(families)))
    for n, split in enumerate(splits):
        found = {r.family: r.rate for r in rates if r.split == split}
        xs = [i + n * width for i in range(len(families))]
        ax.bar(xs, [found.get(f, 0.0) for f in families], width, label=split)
    ax.set_xticks([i + width * (len(splits) - 1) / 2 for i in range(len(families))])
    ax.set_xticklabels(families, rotation=45, ha="right")
    ax.set_ylim(0, 1.05)
    _save(fig, ax, path, title, "success rate")
