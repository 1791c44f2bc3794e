"""The shipped terminal task set: every checker is verified both ways on the host (the reference
solution passes it, the untouched workspace fails it, with only the task's tools on PATH), near
misses fail, and the splits are deterministic held-out instances of the trained skills."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from clawrl.environments.tasks import (
    SPLITS,
    Task,
    check_task,
    list_split,
    load_taskset,
    run_sh,
    seed_workspace,
    tool_dir,
)

TASKSET = load_taskset()
TINY_MODEL_FAMILIES = ("empty_file", "make_dir", "delete_file", "write_file")


def test_the_set_has_at_least_60_tasks_in_at_least_8_families_split_about_70_30() -> None:
    counts = TASKSET.counts()
    assert len(TASKSET.tasks) >= 60
    assert len(counts) >= 8
    for family, by_split in counts.items():
        total = by_split["train"] + by_split["heldout"]
        assert by_split["heldout"] >= 2, family
        assert 0.6 <= by_split["train"] / total <= 0.8, (family, by_split)
    # One-command families a 135M model can hit by chance.
    assert set(TINY_MODEL_FAMILIES) <= set(counts)


@pytest.mark.parametrize("task", TASKSET.tasks, ids=lambda t: t.id)
def test_the_checker_passes_the_solution_and_fails_the_untouched_workspace(
    task: Task, tmp_path: Path
) -> None:
    assert check_task(task, tmp_path) == []


# A plausible wrong attempt per family: each must fail its task's checker.
NEAR_MISSES = {
    "empty_file.notes": ["echo > notes.txt", "mkdir notes.txt", "touch note.txt"],
    "make_dir.reports": ["touch reports", "mkdir report"],
    "make_dir.projects_web": ["mkdir projects", "mkdir web"],
    "write_file.greeting": ["echo Hello > greeting.txt", "printf 'hello\\n\\n' > greeting.txt"],
    "write_file.motto": ["echo keep it > motto.txt", "echo hello > greetings.txt"],
    "delete_file.old_log": ["rm *", "echo > old.log", "rm notes.txt"],
    "append_line.shopping": ["echo milk > shopping.txt", "echo milk >> shoping.txt"],
    "copy_file.report": ["mv report.txt report.bak", "touch report.bak"],
    "copy_file.into_archive": ["cp photo_list.txt archive.txt"],
    "move_file.draft": ["cp draft.txt final.txt", "touch final.txt && rm draft.txt"],
    "count_lines.fruits": ["wc -l fruits.txt > answer.txt", "echo 6 > answer.txt"],
    "count_matches.errors": [
        "grep ERROR server.log > answer.txt",
        "grep -c INFO server.log > answer.txt",
    ],
    "filter_lines.errors": ["grep -v ERROR app.log > errors.txt", "cp app.log errors.txt"],
    "sort_lines.numbers": ["sort numbers.txt > sorted.txt", "sort -rn numbers.txt > sorted.txt"],
    "dedupe_lines.colors": ["uniq colors.txt > unique.txt", "sort colors.txt > unique.txt"],
    "extract_column.ages": ["cut -d, -f1 people.csv > ages.txt", "cp people.csv ages.txt"],
    "replace_text.localhost": [
        "sed 's/localhost/127.0.0.1/g' config.txt > new.txt",
        "sed -i 's/localhost/127.0.0.1/' config.txt",
        "echo 127.0.0.1 > config.txt",
    ],
    "replace_text.monday": ["sed -i 's/Monday/Friday/' plan.txt && sed -i 's/Gym/Pool/' plan.txt"],
    "head_tail.first3": ["head -n 2 story.txt > top.txt", "tail -n 3 story.txt > top.txt"],
}


def test_every_family_has_near_misses() -> None:
    assert {task_id.split(".")[0] for task_id in NEAR_MISSES} == set(TASKSET.families())


@pytest.mark.parametrize(
    ("task_id", "attempt"),
    [(task_id, attempt) for task_id, attempts in NEAR_MISSES.items() for attempt in attempts],
)
def test_a_near_miss_fails_the_checker(task_id: str, attempt: str, tmp_path: Path) -> None:
    task = TASKSET.get(task_id)
    bin_dir = tool_dir([*task.tools, "rm", "cp", "mv", "touch", "mkdir", "sed"], tmp_path / "bin")
    work = tmp_path / "work"
    work.mkdir()
    seed_workspace(task, work)
    status, output = run_sh(attempt, work, bin_dir, 10)
    assert status == 0, output  # the attempt itself ran
    status, _ = run_sh(task.checker, work, bin_dir, 10)
    assert status != 0


def test_a_solution_needing_an_unlisted_tool_is_caught(tmp_path: Path) -> None:
    # The host check runs with only the task's tools on PATH, as the sandbox does.
    task = TASKSET.get("empty_file.notes").model_copy(update={"tools": ("sh", "ls")})
    problems = check_task(task, tmp_path)
    assert len(problems) == 2
    assert problems[0].startswith("solution exits 127")
    assert problems[1].startswith("checker fails the solution")


def test_heldout_tasks_are_new_instances_of_trained_skills() -> None:
    train = TASKSET.split("train")
    for task in TASKSET.split("heldout"):
        same_family = [t for t in train if t.family == task.family]
        assert same_family, task.id
        assert task.instruction not in {t.instruction for t in train}, task.id
        assert task.solution not in {t.solution for t in train}, task.id
        # The tools are the family's: a held-out task asks for no skill train lacks.
        assert set(task.tools) <= set().union(*(t.tools for t in same_family)), task.id


def test_splits_are_deterministic_and_cover_the_set() -> None:
    first = [t.id for t in list_split("heldout")]
    assert first == [t.id for t in list_split("heldout")]
    assert first == sorted(first)
    together = [t.id for split in SPLITS for t in TASKSET.split(split)]
    assert sorted(together) == [t.id for t in TASKSET.tasks]
    assert Counter(together).most_common(1)[0][1] == 1


def test_the_agent_view_holds_no_checker_and_no_solution() -> None:
    for task in TASKSET.tasks:
        view = task.agent_view()
        assert task.checker not in view.values()
        assert "solution" not in view and "checker" not in view and "files" not in view
        assert view["instruction"] == task.instruction


def test_the_cli_lists_ids_and_family_counts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "clawrl.environments.tasks", "--list", "--split", "heldout"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = done.stdout.splitlines()
    heldout = TASKSET.split("heldout")
    assert lines[: len(heldout)] == [
        f"{t.id:<{max(len(x.id) for x in TASKSET.tasks)}}  {t.family:<16}  heldout" for t in heldout
    ]
    assert lines[len(heldout)] == ""
    assert lines[len(heldout) + 1].split() == ["family", "heldout"]
    assert lines[-1].split() == ["total", str(len(heldout))]
    counts = {line.split()[0]: int(line.split()[1]) for line in lines[len(heldout) + 2 : -1]}
    assert counts == {f: c["heldout"] for f, c in TASKSET.counts().items()}
