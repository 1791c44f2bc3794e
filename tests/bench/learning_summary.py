"""One table and one plot of every learning run: reads each docs/learning-*.csv (written by
`bench_learning.py --docs`; the older ones without method columns are read as the rl runs with
the fixed-remark keyword reward they were), prints one markdown table (method, seed, remarks,
turns, versions, held-out v0 -> final, reward trend, base NLL v0 -> final, whether it learned and
what the judge and trainer counted) and draws the held-out score per version per method.

    .venv/bin/python tests/bench/learning_summary.py [--docs docs] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import csv
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The held-out gain the issue asks of a method that learns (its "Done when").
LEARNS_BY = 0.2
# The plot file is no run: never read back as one.
PLOT_NAME = "learning-methods.png"


@dataclass(frozen=True)
class Run:
    name: str  # the CSV's stem
    method: str
    seed: str
    remarks: str
    reward_fn: str
    turns: int
    versions: int  # the newest version that served a turn or was scored
    held_out: list[tuple[int, float]]  # (version, score) of the evaluated versions
    rewards: list[tuple[int, float]]  # (version, mean reward) of the rewarded versions
    base_nll: list[tuple[int, float]]  # (version, base NLL per token) of the evaluated ones
    signal: str  # what the judge and trainer counted ("" for older runs)


def _series(rows: list[dict[str, str]], column: str) -> list[tuple[int, float]]:
    return [(int(r["policy_version"]), float(r[column])) for r in rows if r.get(column)]


def read_run(path: Path) -> Run:
    """A run from its CSV; the settings columns (method, seed, ...) when it has them, else
    what the file's name and the older runs' setup say (rl with a keyword reward, fixed
    remarks)."""
    rows = list(csv.DictReader(path.open()))
    if not rows:
        raise ValueError(f"{path}: no versions")
    first = rows[0]
    seed = re.search(r"seed(\d+)", path.stem)
    keyword = "arithmetic_confirmed" if "accuracy" in first else "stated_preference"
    return Run(
        name=path.stem,
        method=first.get("method") or "rl",
        seed=first.get("seed") or (seed.group(1) if seed else "-"),
        remarks=first.get("remarks") or "fixed",
        reward_fn=(first.get("reward_fn") or keyword).rsplit(":", 1)[-1],
        turns=sum(int(r["turns"]) for r in rows),
        versions=max(int(r["policy_version"]) for r in rows),
        held_out=_series(rows, "held_out_score"),
        rewards=_series(rows, "reward_mean"),
        base_nll=_series(rows, "held_out_base_nll"),
        signal=first.get("signal") or "",
    )


def first_to_last(series: list[tuple[int, float]], spec: str) -> str:
    """v0's value -> the last version's (with the gain); '-' without v0 and a later one."""
    if len(series) < 2 or series[0][0] != 0:
        return "-"
    (_, start), (last, end) = series[0], series[-1]
    return f"{start:{spec}} -> {end:{spec}} (v{last}, {end - start:+.3f})"


def reward_trend(rewards: list[tuple[int, float]]) -> str:
    """Mean reward of the last 3 rewarded versions vs v0's (bench_learning's goal figure)."""
    if len(rewards) < 4 or rewards[0][0] != 0:
        return "-"
    last = sum(reward for _, reward in rewards[-3:]) / 3
    return f"{rewards[0][1]:+.3f} -> {last:+.3f} ({last - rewards[0][1]:+.3f})"


def learned(run: Run) -> str:
    """yes / no by the held-out gain (v0 -> final >= LEARNS_BY); no says what was counted."""
    if run.versions == 0:  # the trainer never stepped: why is in what the judge counted
        return "no (no version past v0: no trainable signal)"
    if len(run.held_out) < 2 or run.held_out[0][0] != 0:
        return "- (no held-out score past v0)"
    gain = run.held_out[-1][1] - run.held_out[0][1]
    if gain >= LEARNS_BY:
        return "yes"
    return f"no (held-out {gain:+.3f})"


def table(runs: list[Run]) -> str:
    header = ["run", "method", "seed", "remarks", "reward", "turns", "versions",
              "held-out v0 -> final", "reward trend (v0 -> last 3)", "base NLL v0 -> final",
              "learns", "judge and trainer counted"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        cells = [run.name, run.method, run.seed, run.remarks, run.reward_fn, str(run.turns),
                 str(run.versions), first_to_last(run.held_out, ".3f"), reward_trend(run.rewards),
                 first_to_last(run.base_nll, ".3f"), learned(run), run.signal or "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> None:
    """The held-out score per version, one line per run, one colour per method."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    methods = sorted({run.method for run in runs})
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    styles = ["o-", "s--", "^-.", "v:", "D-"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, run in enumerate(r for r in runs if r.held_out):
        versions, scores = zip(*run.held_out, strict=True)
        ax.plot(versions, scores, styles[index % len(styles)], color=colours[run.method],
                label=f"{run.method}, seed {run.seed}, {run.remarks} ({run.name})")  # fmt: skip
    ax.set_xlabel("policy version")
    ax.set_ylabel("held-out score (greedy, never trained)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Held-out score per version, every learning run")
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def runs_in(docs: Path) -> list[Run]:
    return [read_run(path) for path in sorted(docs.glob("learning-*.csv"))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=Path, default=REPO / "docs", help="the learning-*.csv")
    parser.add_argument("--plot", type=Path, help=f"the plot (default: <docs>/{PLOT_NAME})")
    args = parser.parse_args(argv)
    runs = runs_in(args.docs)
    if not runs:
        raise SystemExit(f"no learning-*.csv in {args.docs}")
    print(table(runs))
    target = args.plot or args.docs / PLOT_NAME
    plot(runs, target)
    print(f"\nwrote {target}")


if __name__ == "__main__":
    main()
