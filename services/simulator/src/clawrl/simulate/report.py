"""Per-policy-version figures of a simulation: accuracy (the simulator's own check of every
reply) and reward (what the judge gave the same turns, read from the samples stream), written as
CSV, a PNG plot and a printed table."""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TurnOutcome:
    """One reply the simulator checked."""

    version: int
    correct: bool


@dataclass(frozen=True)
class VersionStats:
    version: int
    turns: int
    accuracy: float
    samples: int  # judged samples with a reward (masked ones excluded)
    reward_mean: float | None


def per_version(
    outcomes: list[TurnOutcome], rewards: list[tuple[int, float]]
) -> list[VersionStats]:
    """Group the checked replies and the (version, reward) of judged samples by version."""
    turns: dict[int, list[bool]] = defaultdict(list)
    for outcome in outcomes:
        turns[outcome.version].append(outcome.correct)
    scored: dict[int, list[float]] = defaultdict(list)
    for version, reward in rewards:
        scored[version].append(reward)
    return [
        VersionStats(
            version=v,
            turns=len(turns[v]),
            accuracy=sum(turns[v]) / len(turns[v]) if turns[v] else 0.0,
            samples=len(scored[v]),
            reward_mean=sum(scored[v]) / len(scored[v]) if scored[v] else None,
        )
        for v in sorted(set(turns) | set(scored))
    ]


def table(stats: list[VersionStats]) -> str:
    lines = [f"{'version':>7}  {'turns':>6}  {'accuracy':>8}  {'samples':>7}  {'reward':>7}"]
    for s in stats:
        reward = f"{s.reward_mean:+.3f}" if s.reward_mean is not None else "-"
        lines.append(
            f"{s.version:>7}  {s.turns:>6}  {s.accuracy:>8.3f}  {s.samples:>7}  {reward:>7}"
        )
    return "\n".join(lines)


def write_csv(stats: list[VersionStats], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["policy_version", "turns", "accuracy", "samples", "reward_mean"])
        for s in stats:
            reward = "" if s.reward_mean is None else f"{s.reward_mean:.4f}"
            writer.writerow([s.version, s.turns, f"{s.accuracy:.4f}", s.samples, reward])


def plot(stats: list[VersionStats], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    versions = [s.version for s in stats]
    ax.plot(versions, [s.accuracy for s in stats], "o-", label="accuracy (simulator's check)")
    rewarded = [s for s in stats if s.reward_mean is not None]
    ax.plot([s.version for s in rewarded], [s.reward_mean for s in rewarded], "s-",
            label="mean reward (judge)")  # fmt: skip
    ax.set_xlabel("policy version")
    ax.set_ylim(-1.05, 1.05)
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xticks(versions)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
