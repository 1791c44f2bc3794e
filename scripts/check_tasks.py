"""Check a terminal task set on this host, without a sandbox: every task's checker must fail on
the untouched workspace and pass after its reference solution, with only the task's tools on
PATH. Prints one line per failing task and a table per family; exits 1 on any failure.

    .venv/bin/python scripts/check_tasks.py [--dir DIR] [--terminal-bench DIR] [--verbose]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from clawrl.environments.tasks import SPLITS, TaskSet, TaskSetError, check_task, load_taskset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="a task set directory (default: the shipped)")
    parser.add_argument("--terminal-bench", type=Path, help="also the Terminal-Bench tasks here")
    parser.add_argument("--verbose", action="store_true", help="a line for every task")
    args = parser.parse_args()
    try:
        taskset = load_taskset(args.dir)
        if args.terminal_bench is not None:
            from clawrl.environments.terminal_bench import load_tasks

            converted = load_tasks(args.terminal_bench)
            for skip in converted.skipped:
                print(f"skipped  {skip.name}: {skip.reason}")
            taskset = TaskSet.of([*taskset.tasks, *converted.tasks])
    except TaskSetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    failed: dict[str, int] = {}
    for task in taskset.tasks:
        with tempfile.TemporaryDirectory(prefix="clawrl-task-") as scratch:
            problems = check_task(task, Path(scratch))
        for problem in problems:
            print(f"FAIL     {task.id}: {problem}")
        if problems:
            failed[task.family] = failed.get(task.family, 0) + 1
        elif args.verbose:
            print(f"ok       {task.id}")
    elapsed = time.monotonic() - start
    counts = taskset.counts()
    width = max(len(f) for f in [*counts, "family"])
    print(f"\n{'family':<{width}}  " + "  ".join(f"{s:>7}" for s in SPLITS) + "   failed")
    for family, by_split in counts.items():
        row = "  ".join(f"{by_split[s]:>7}" for s in SPLITS)
        print(f"{family:<{width}}  {row}  {failed.get(family, 0):>7}")
    total = sum(failed.values())
    print(f"\n{len(taskset.tasks)} tasks checked in {elapsed:.1f} s, {total} failed")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
