"""Per-policy-version figures of a simulation: the simulator's own check of every reply (the
preference met, or the arithmetic right), the reward the judge gave the same turns (read from
the samples stream) and the held-out score (`clawrl eval`), written as CSV, a PNG plot and a
printed table."""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from clawrl.simulate.evaluation import HeldOutScore


@dataclass(frozen=True)
class TurnOutcome:
    """One reply the simulator checked."""

    version: int
    ok: bool  # passed the user's check


@dataclass(frozen=True)
class VersionStats:
    version: int
    turns: int
    passed: float  # share of the turns that passed the user's check
    samples: int  # judged samples with a reward (masked ones excluded)
    reward_mean: float | None
    held_out: float | None = None  # held-out score, when this version was evaluated
    # This user's held-out score under another tenant's adapter of this version number
    # (`clawrl simulate --tenants 2`): isolation keeps it from following this user's taste.
    cross: float | None = None
    base_nll: float | None = None  # the base model's mean NLL per token of the held-out replies


def per_version(
    outcomes: list[TurnOutcome],
    rewards: list[tuple[int, float]],
    held_out: list[HeldOutScore] = (),
    cross: list[HeldOutScore] = (),
) -> list[VersionStats]:
    """Group the checked replies, the (version, reward) of judged samples and the held-out
    scores (own, and under the other tenant's adapter) by version."""
    turns: dict[int, list[bool]] = defaultdict(list)
    for outcome in outcomes:
        turns[outcome.version].append(outcome.ok)
    scored: dict[int, list[float]] = defaultdict(list)
    for version, reward in rewards:
        scored[version].append(reward)
    evaluated = {s.version: s.score for s in held_out}
    fluency = {s.version: s.base_nll for s in held_out if s.base_nll is not None}
    crossed = {s.version: s.score for s in cross}
    return [
        VersionStats(
            version=v,
            turns=len(turns[v]),
            passed=sum(turns[v]) / len(turns[v]) if turns[v] else 0.0,
            samples=len(scored[v]),
            reward_mean=sum(scored[v]) / len(scored[v]) if scored[v] else None,
            held_out=evaluated.get(v),
            cross=crossed.get(v),
            base_nll=fluency.get(v),
        )
        for v in sorted(set(turns) | set(scored) | set(evaluated) | set(crossed))
    ]


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _crossed(stats: list[VersionStats]) -> bool:
    return any(s.cross is not None for s in stats)


def _fluent(stats: list[VersionStats]) -> bool:
    return any(s.base_nll is not None for s in stats)


def table(stats: list[VersionStats], check_name: str = "liked") -> str:
    crossed, fluent = _crossed(stats), _fluent(stats)
    lines = [
        f"{'version':>7}  {'turns':>6}  {check_name:>8}  {'samples':>7}  {'reward':>7}  "
        f"{'held-out':>8}"
        + (f"  {'other adapter':>13}" if crossed else "")
        + (f"  {'base NLL':>8}" if fluent else "")
    ]
    for s in stats:
        lines.append(
            f"{s.version:>7}  {s.turns:>6}  {s.passed:>8.3f}  {s.samples:>7}  "
            f"{_number(s.reward_mean, '+.3f'):>7}  {_number(s.held_out, '.3f'):>8}"
            + (f"  {_number(s.cross, '.3f'):>13}" if crossed else "")
            + (f"  {_number(s.base_nll, '.3f'):>8}" if fluent else "")
        )
    return "\n".join(lines)


def write_csv(stats: list[VersionStats], path: Path, check_name: str = "liked") -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        crossed, fluent = _crossed(stats), _fluent(stats)
        writer.writerow(
            ["policy_version", "turns", check_name, "samples", "reward_mean", "held_out_score"]
            + (["held_out_other_adapter"] if crossed else [])
            + (["held_out_base_nll"] if fluent else [])
        )
        for s in stats:
            scores = (
                [s.reward_mean, s.held_out]
                + ([s.cross] if crossed else [])
                + ([s.base_nll] if fluent else [])
            )
            cells = ["" if value is None else f"{value:.4f}" for value in scores]
            writer.writerow([s.version, s.turns, f"{s.passed:.4f}", s.samples, *cells])


def plot(stats: list[VersionStats], path: Path, title: str, check_name: str = "liked") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    versions = [s.version for s in stats]
    served = [s for s in stats if s.turns]
    ax.plot([s.version for s in served], [s.passed for s in served], "o-",
            label=f"{check_name} (simulator's check of live replies)")  # fmt: skip
    rewarded = [s for s in stats if s.reward_mean is not None]
    ax.plot([s.version for s in rewarded], [s.reward_mean for s in rewarded], "s-",
            label="mean reward (judge)")  # fmt: skip
    evaluated = [s for s in stats if s.held_out is not None]
    if evaluated:
        ax.plot([s.version for s in evaluated], [s.held_out for s in evaluated], "^-",
                label="held-out score (greedy, never trained)")  # fmt: skip
    crossed = [s for s in stats if s.cross is not None]
    if crossed:
        ax.plot([s.version for s in crossed], [s.cross for s in crossed], "v--",
                label="held-out score under the other tenant's adapter")  # fmt: skip
    ax.set_xlabel("policy version")
    ax.set_ylim(-1.05, 1.05)
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xticks(versions)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
