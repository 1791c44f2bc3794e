"""Two tenants learn apart: `make run`'s stack in per-tenant mode (`--tenants per_tenant`, two
API keys; otherwise the learning demo's recipe: a LoRA adapter of SmolLM2-135M, lr 5e-4, the
batch's mean reward as baseline, the judge's `stated_preference`) driven by `clawrl simulate
--tenants 2`: tenant a wants one paragraph, tenant b points on separate lines, the opposite
taste. Each tenant's samples train its own adapter and each is served its own versions.

Prints each tenant's per-version table (its check of live replies, the judged reward; with
--held-out-every, the held-out score under its own adapter and under the other tenant's adapter
of the same version number), each tenant's reward gain (last 3 versions vs v0), then the
held-out scores pinned on the engine: each tenant's taste on the base model, under its own final
adapter and under the other tenant's final adapter. Writes the CSVs and a plot of both tenants
(to docs/ with --docs). Asserts nothing.

    .venv/bin/python tests/bench/bench_tenants.py [--minutes 14] [--seed 0] [--docs]
"""

from __future__ import annotations

import argparse
import csv
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from clawrl.common.tenants import key_tenant  # noqa: E402
from tests.bench.bench_learning import (  # noqa: E402
    engine_held_out,
    goal,
    running_stack,
    simulate_until,
)

KEYS = ("tenant-a", "tenant-b")
SCENARIOS = ("preference", "lines")  # the simulator's scenarios of tenants a and b
TASTES = ("paragraph", "lines")  # their held-out tastes (`clawrl eval --taste`)


# The CSV columns plotted per tenant.
LINES = (
    ("reward_mean", "s-", "mean reward (judge)"),
    ("held_out_score", "^-", "held-out, own adapter"),
    ("held_out_other_adapter", "v--", "held-out, the other tenant's adapter"),
)


def rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def final_version(path: Path) -> int:
    return max((int(r["policy_version"]) for r in rows(path)), default=0)


def series(path: Path, column: str) -> tuple[list[int], list[float]]:
    found = [(int(r["policy_version"]), float(r[column])) for r in rows(path) if r.get(column)]
    return [v for v, _ in found], [x for _, x in found]


@dataclass(frozen=True)
class Pinned:
    """A tenant's held-out scores on the engine, pinned: its taste on the base model, under its
    own final adapter and under the other tenant's final adapter."""

    base: float
    own_version: int
    own: float
    other_version: int
    other: float


def plot(csvs: list[Path], pinned: list[Pinned | None], target: Path, title: str) -> None:
    """One panel per tenant: the judged reward of its versions, its held-out score under its own
    adapter and under the other tenant's adapter (of the same version number during the run;
    the final ones, pinned, at the end)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(csvs), figsize=(12, 4), sharey=True)
    for ax, path, scores, key, scenario in zip(axes, csvs, pinned, KEYS, SCENARIOS, strict=True):
        for column, style, label in LINES:
            versions, values = series(path, column)
            if versions:
                ax.plot(versions, values, style, label=label)
        if scores is not None:
            last = scores.own_version
            ax.plot([0, last], [scores.base, scores.own], "^:", color="tab:orange",
                    label=f"held-out, own adapter v{last} (pinned)")  # fmt: skip
            other = f"held-out, the other's adapter v{scores.other_version} (pinned)"
            ax.plot([0, last], [scores.base, scores.other], "v:", color="tab:green", label=other)
        ax.set_title(f"{key}: wants {'one paragraph' if scenario == 'preference' else 'lines'}")
        ax.set_xlabel("version of the tenant's adapter")
        ax.set_ylim(-1.05, 1.05)
        ax.axhline(0, color="grey", linewidth=0.5)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument(
        "--minutes", type=float, default=14.0, help="from the stack's start to the last session"
    )
    parser.add_argument("--seed", type=int, default=0, help="the simulated users' seed")
    parser.add_argument("--concurrency", type=int, default=2, help="sessions at once per tenant")
    parser.add_argument(
        "--tenant-batch", type=int, default=8, help="samples per step of a tenant's adapter"
    )
    parser.add_argument(
        "--held-out-every",
        type=int,
        default=0,
        help="versions between held-out scores during the run (0: none; each is 4 evaluations "
        "of 32 questions that take the engine from the live sessions); the final versions are "
        "always scored at the end, pinned on the engine",
    )
    parser.add_argument("--stack-args", default="", help="more stack.py flags (e.g. --lr 1e-3)")
    parser.add_argument("--docs", action="store_true", help="copy the CSVs and PNG to docs/")
    args = parser.parse_args()
    started = time.monotonic()
    stack_args = ["--tenants", "per_tenant", "--tenant-batch", str(args.tenant_batch),
                  *(arg for key in KEYS for arg in ("--api-key", key)),
                  *shlex.split(args.stack_args)]  # fmt: skip
    with running_stack(args.model, "bench-tenants-", "stated_preference", stack_args) as (
        ports,
        run_dir,
        env,
    ):
        print(f"stack up after {time.monotonic() - started:.0f}s", flush=True)
        out = run_dir / "simulate"
        engine = f"http://127.0.0.1:{ports['policy']}"
        simulate_until(
            ports, env, started + args.minutes * 60,
            ["--tenants", "2", "--tenant-keys", ",".join(KEYS),
             "--tenant-scenarios", ",".join(SCENARIOS), "--engine-url", engine,
             "--seed", str(args.seed), "--concurrency", str(args.concurrency),
             *(["--held-out-every", str(args.held_out_every)] if args.held_out_every
               else ["--no-held-out"]),
             "--out-dir", str(out)],
        )  # fmt: skip
        csvs = [next(out.glob(f"simulate-*-{name}.csv")) for name in ("a", "b")]
        finals = [final_version(path) for path in csvs]
        prefixes = [f"tenant-{key_tenant(key)}" for key in KEYS]
        found = []
        for index, (key, path) in enumerate(zip(KEYS, csvs, strict=True)):
            other = 1 - index
            print(f"\n{key} ({TASTES[index]}): {goal(path)}", flush=True)
            taste = TASTES[index]
            base = engine_held_out(engine, None, env, taste)
            own = newest_pinned(engine, prefixes[index], finals[index], env, taste)
            cross = newest_pinned(engine, prefixes[other], finals[other], env, taste)
            if base is None or own is None or cross is None:
                found.append(None)
                continue
            found.append(Pinned(base, own[0], own[1], cross[0], cross[1]))
            print(f"{key} held-out (engine, pinned): base {base:.3f}, own v{own[0]} "
                  f"{own[1]:.3f} ({own[1] - base:+.3f}), {KEYS[other]}'s v{cross[0]} "
                  f"{cross[1]:.3f} ({cross[1] - base:+.3f})", flush=True)  # fmt: skip
        minutes = (time.monotonic() - started) / 60
        title = f"Two tenants, opposite tastes: {args.model}, seed {args.seed}, {minutes:.0f} min"
        made = out / "tenants.png"
        plot(csvs, found, made, title)
        summary = out / "held-out.csv"
        write_summary(found, summary)
        print(f"wrote {made} and {summary}")
        if args.docs:
            docs = REPO / "docs"
            stem = f"tenants-{args.model}-seed{args.seed}"
            for name, path in zip(("a", "b"), csvs, strict=True):
                shutil.copy(path, docs / f"{stem}-{name}.csv")
            shutil.copy(made, docs / f"{stem}.png")
            shutil.copy(summary, docs / f"{stem}-held-out.csv")
            print(f"wrote {docs}/{stem}-a.csv, -b.csv, -held-out.csv and .png")
        print((run_dir / "stack.log").read_text().splitlines()[-1])


def newest_pinned(
    engine: str, prefix: str, version: int, env: dict, taste: str
) -> tuple[int, float] | None:
    """(version, score): a taste's held-out score on the engine pinned to a tenant's adapter
    (base for v0), the final version the simulation saw or, when the trainer made newer ones
    from the last samples and the engine holds those instead, the next one it holds."""
    for newer in range(version, version + 4):
        score = engine_held_out(engine, f"{prefix}-v{newer}" if newer else None, env, taste)
        if score is not None:
            return newer, score
    return None


def write_summary(found: list[Pinned | None], path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["tenant", "taste", "base", "own_version", "own", "other_version",
                         "other"])  # fmt: skip
        for key, taste, scores in zip(KEYS, TASTES, found, strict=True):
            if scores is not None:
                writer.writerow([key, taste, f"{scores.base:.4f}", scores.own_version,
                                 f"{scores.own:.4f}", scores.other_version,
                                 f"{scores.other:.4f}"])  # fmt: skip


if __name__ == "__main__":
    main()
