"""Terminal task sets: the `Task` record, the loader of the TOML family files shipped under
`tasksets/terminal/` (every field validated, errors naming the file and the task), the split
lists the agent runner and `clawrl eval --track terminal` draw from, and a host-side check that
each task's checker passes on its reference solution and fails on the untouched workspace.

A task is played in a sandbox: its `files` are seeded into a fresh workspace, the agent runs
shell commands there (only `tools` on its PATH), and after the episode `checker` (a POSIX sh
script, run in the workspace) decides the outcome by its exit status: 0 = solved. `solution` is
a reference answer for the tests only; `agent_view` is what may reach the model.

    python -m clawrl.environments.tasks --list [--split heldout] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SPLITS = ("train", "heldout")
Split = Literal["train", "heldout"]

# "Small" workspaces: a sandbox is seeded per lease, and the whole task travels in every
# allocate request, so a file set of a few KiB is the intent; these caps catch mistakes.
MAX_FILE_BYTES = 64 * 1024
MAX_WORKSPACE_BYTES = 256 * 1024

_FAMILY = re.compile(r"^[a-z0-9][a-z0-9_]{0,39}$")
_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,99}$")
_TOOL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")

# The keys of a family file; `[defaults]` may set any task field but these per-task ones.
_FILE_KEYS = {"family", "description", "defaults", "tasks"}
_PER_TASK_ONLY = {"id", "split", "instruction", "checker", "solution", "files", "family"}


class TaskSetError(ValueError):
    """A task set that cannot be used; the message names the file and the task."""


class Task(BaseModel):
    """One terminal task. Frozen: a loaded set is shared by every episode of a run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Unique id, `<family>.<name>`.")
    family: str = Field(description="The skill it exercises; splits and rates are per family.")
    split: Split = Field(description="train (the runner plays it) or heldout (eval only).")
    instruction: str = Field(
        min_length=1, max_length=20_000, description="The user's request, plain English."
    )
    files: dict[str, str] = Field(
        default_factory=dict, description="Workspace files to seed: relative path -> text."
    )
    tools: tuple[str, ...] = Field(
        min_length=1, description="Commands on the sandbox's PATH (for the agent and checker)."
    )
    max_steps: int = Field(ge=1, le=100, description="Most shell commands in one episode.")
    command_timeout_s: float = Field(gt=0, le=600, description="Limit on each shell command.")
    checker: str = Field(min_length=1, description="POSIX sh run in the workspace; 0 = solved.")
    checker_timeout_s: float = Field(default=10.0, gt=0, le=600, description="Checker's limit.")
    solution: str = Field(
        min_length=1, description="Reference commands (sh), for tests; never shown to the agent."
    )
    workdir: str | None = Field(
        default=None,
        description="Absolute path the task expects its workspace at (Terminal-Bench's "
        "WORKDIR); None: wherever the sandbox puts it.",
    )

    @field_validator("family")
    @classmethod
    def _family_name(cls, value: str) -> str:
        if not _FAMILY.match(value):
            raise ValueError(f"{value!r} is not a family name (lower case, digits, _)")
        return value

    @field_validator("id")
    @classmethod
    def _id_shape(cls, value: str) -> str:
        if not _ID.match(value):
            raise ValueError(f"{value!r} is not a task id (lower case, digits, _ . -)")
        return value

    @field_validator("instruction", "checker", "solution")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        if "\0" in value:
            raise ValueError("must not contain NUL")
        return value

    @field_validator("files")
    @classmethod
    def _small_relative_files(cls, files: dict[str, str]) -> dict[str, str]:
        total = 0
        for path, content in files.items():
            _check_relative(path)
            size = len(content.encode())
            if size > MAX_FILE_BYTES:
                raise ValueError(f"{path}: {size} bytes, over the {MAX_FILE_BYTES} allowed")
            if "\0" in content:
                raise ValueError(f"{path}: contains NUL (text files only)")
            total += size
        if total > MAX_WORKSPACE_BYTES:
            raise ValueError(f"{total} bytes in all, over the {MAX_WORKSPACE_BYTES} allowed")
        dirs = {str(p) for path in files for p in PurePosixPath(path).parents}
        clash = sorted(set(files) & dirs)
        if clash:
            raise ValueError(f"{clash[0]} is both a file and a directory")
        return files

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, tools: tuple[str, ...]) -> tuple[str, ...]:
        bad = [t for t in tools if not _TOOL.match(t)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a command name")
        repeated = sorted(t for t, n in Counter(tools).items() if n > 1)
        if repeated:
            raise ValueError(f"{repeated[0]} listed twice")
        # The agent's tool and the checker are both run by sh.
        if "sh" not in tools:
            raise ValueError("must include sh")
        return tools

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: str | None) -> str | None:
        if value is not None and not PurePosixPath(value).is_absolute():
            raise ValueError(f"{value!r} is not an absolute path")
        return value

    @model_validator(mode="after")
    def _id_in_family(self) -> Task:
        if not self.id.startswith(f"{self.family}."):
            raise ValueError(f"id {self.id!r} must start with its family, {self.family + '.'!r}")
        return self

    def agent_view(self) -> dict[str, Any]:
        """What may reach the agent: no checker, no solution."""
        return {
            "id": self.id,
            "family": self.family,
            "split": self.split,
            "instruction": self.instruction,
            "tools": list(self.tools),
            "max_steps": self.max_steps,
            "command_timeout_s": self.command_timeout_s,
        }


def _check_relative(path: str) -> None:
    """A workspace path: relative, normalised, inside the workspace."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path!r} is not a relative path inside the workspace")


@dataclass(frozen=True)
class TaskSet:
    """Tasks sorted by id, so every listing and split is deterministic."""

    tasks: tuple[Task, ...]

    @classmethod
    def of(cls, tasks: Iterable[Task]) -> TaskSet:
        """A set from tasks whose ids must be unique."""
        tasks = list(tasks)
        repeated = sorted(i for i, n in Counter(t.id for t in tasks).items() if n > 1)
        if repeated:
            raise TaskSetError(f"duplicate task id {repeated[0]}")
        return cls(tuple(sorted(tasks, key=lambda t: t.id)))

    def split(self, split: str) -> list[Task]:
        """The tasks of one split, by id."""
        if split not in SPLITS:
            raise TaskSetError(f"unknown split {split!r}; one of {', '.join(SPLITS)}")
        return [t for t in self.tasks if t.split == split]

    def get(self, task_id: str) -> Task:
        for task in self.tasks:
            if task.id == task_id:
                return task
        raise KeyError(f"no task {task_id!r} in this set")

    def families(self) -> list[str]:
        return sorted({t.family for t in self.tasks})

    def counts(self) -> dict[str, dict[str, int]]:
        """family -> split -> number of tasks (every split present, 0 when none)."""
        counts = {f: dict.fromkeys(SPLITS, 0) for f in self.families()}
        for task in self.tasks:
            counts[task.family][task.split] += 1
        return counts


def format_validation_error(exc: ValidationError) -> str:
    """Pydantic's errors as `field: message; ...` (the task is named by the caller)."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field"
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def parse_family(text: str, source: str) -> list[Task]:
    """The tasks of one family file's TOML `text`; TaskSetError naming `source` and the task.

    Layout: `family = "..."`, an optional `description`, an optional `[defaults]` table with
    fields shared by the family's tasks, then `[[tasks]]` tables. A family must have tasks in
    both splits, so every skill is measured on held-out instances."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskSetError(f"{source}: not TOML: {exc}") from exc
    unknown = sorted(set(data) - _FILE_KEYS)
    if unknown:
        raise TaskSetError(f"{source}: unknown key {unknown[0]!r} (allowed: {sorted(_FILE_KEYS)})")
    family = data.get("family")
    if not isinstance(family, str):
        raise TaskSetError(f'{source}: `family = "..."` is missing')
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise TaskSetError(f"{source}: [defaults] must be a table")
    per_task = sorted(set(defaults) & _PER_TASK_ONLY)
    if per_task:
        raise TaskSetError(f"{source}: [defaults] cannot set {per_task[0]!r}")
    entries = data.get("tasks")
    if not isinstance(entries, list) or not entries:
        raise TaskSetError(f"{source}: no [[tasks]]")
    tasks = [_parse_task(entry, n, family, defaults, source) for n, entry in enumerate(entries)]
    repeated = sorted(i for i, n in Counter(t.id for t in tasks).items() if n > 1)
    if repeated:
        raise TaskSetError(f"{source}: duplicate task id {repeated[0]}")
    splits = {t.split for t in tasks}
    for split in SPLITS:
        if split not in splits:
            raise TaskSetError(f"{source}: family {family} has no {split} task")
    return tasks


def _parse_task(entry: Any, n: int, family: str, defaults: dict, source: str) -> Task:
    if not isinstance(entry, dict):
        raise TaskSetError(f"{source}: tasks[{n}] is not a table")
    name = entry.get("id", f"tasks[{n}]")
    if "family" in entry:
        raise TaskSetError(f"{source}: task {name}: family is set once, at the top of the file")
    if "checker" not in entry:
        raise TaskSetError(f"{source}: task {name}: no checker")
    try:
        return Task.model_validate({**defaults, **entry, "family": family})
    except ValidationError as exc:
        raise TaskSetError(f"{source}: task {name}: {format_validation_error(exc)}") from exc


def shipped_dir(name: str = "terminal") -> Traversable:
    """The packaged task set directory `tasksets/<name>/`."""
    return resources.files("clawrl.environments").joinpath("tasksets", name)


def load_taskset(directory: Path | Traversable | None = None) -> TaskSet:
    """Every `*.toml` family file of `directory` (default: the shipped terminal set) as one
    set; family names and task ids must be unique across the files."""
    directory = shipped_dir() if directory is None else directory
    if not directory.is_dir():
        raise TaskSetError(f"{directory}: no such task set directory")
    files = sorted((f for f in directory.iterdir() if f.name.endswith(".toml")), key=_name)
    if not files:
        raise TaskSetError(f"{directory}: no *.toml family files")
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for file in files:
        source = f"{directory}/{file.name}"
        family = parse_family(file.read_text(encoding="utf-8"), source)
        name = family[0].family
        if name in seen:
            raise TaskSetError(f"{source}: family {name} is also defined in {seen[name]}")
        seen[name] = source
        tasks.extend(family)
    try:
        return TaskSet.of(tasks)
    except TaskSetError as exc:
        raise TaskSetError(f"{directory}: {exc}") from exc


def _name(entry: Traversable) -> str:
    return entry.name


def list_split(split: str, directory: Path | Traversable | None = None) -> list[Task]:
    """The tasks of one split of a set (default: the shipped one), sorted by id."""
    return load_taskset(directory).split(split)


# --- host-side check: reference solution passes, untouched workspace fails -----------------


def seed_workspace(task: Task, root: Path) -> None:
    """Write the task's files under `root` (which must exist)."""
    for path, content in task.files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")


def tool_dir(tools: Sequence[str], dest: Path) -> Path:
    """A PATH directory holding only `tools` (links to the host's), so a solution or checker
    that needs an unlisted command fails here as it would in the sandbox."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = []
    for tool in tools:
        found = shutil.which(tool)
        if found is None:
            missing.append(tool)
            continue
        link = dest / tool
        if not link.exists():
            link.symlink_to(found)
    if missing:
        raise TaskSetError(f"tools missing on this host: {', '.join(missing)}")
    return dest


def run_sh(script: str, cwd: Path, bin_dir: Path, timeout_s: float) -> tuple[int, str]:
    """Run `script` with sh in `cwd`, only `bin_dir` on PATH and the sandbox's locale;
    (status, output). A script past its time limit reads as status 124, like timeout(1)."""
    sh = str(bin_dir / "sh")
    env = {"PATH": str(bin_dir), "HOME": str(cwd), "LANG": "C.UTF-8", "TMPDIR": str(cwd.parent)}
    try:
        done = subprocess.run(
            [sh, "-c", script],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s} s"
    return done.returncode, (done.stdout + done.stderr)[-2000:]


def check_task(task: Task, scratch: Path) -> list[str]:
    """Problems with `task` ([] when none): its checker must fail on the untouched workspace,
    and its solution must run cleanly and then pass the checker. `scratch` is an empty
    directory this may fill."""
    bin_dir = tool_dir(task.tools, scratch / "bin")
    problems = []
    untouched = scratch / "untouched"
    untouched.mkdir()
    seed_workspace(task, untouched)
    status, _ = run_sh(task.checker, untouched, bin_dir, task.checker_timeout_s)
    if status == 0:
        problems.append("checker passes on the untouched workspace")
    solved = scratch / "solved"
    solved.mkdir()
    seed_workspace(task, solved)
    status, output = run_sh(task.solution, solved, bin_dir, task.checker_timeout_s)
    if status != 0:
        problems.append(f"solution exits {status}: {output.strip()}")
    status, output = run_sh(task.checker, solved, bin_dir, task.checker_timeout_s)
    if status != 0:
        problems.append(f"checker fails the solution (exit {status}): {output.strip()}")
    return problems


# --- CLI -------------------------------------------------------------------------------------


def _table(counts: dict[str, dict[str, int]], splits: Sequence[str]) -> list[str]:
    width = max([len("family"), len("total"), *map(len, counts)])
    rows = [f"{'family':<{width}}  " + "  ".join(f"{s:>7}" for s in splits)]
    for family, by_split in counts.items():
        rows.append(f"{family:<{width}}  " + "  ".join(f"{by_split[s]:>7}" for s in splits))
    totals = [sum(c[s] for c in counts.values()) for s in splits]
    rows.append(f"{'total':<{width}}  " + "  ".join(f"{n:>7}" for n in totals))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clawrl.environments.tasks", description="List a terminal task set."
    )
    parser.add_argument("--list", action="store_true", help="list task ids and family counts")
    parser.add_argument("--split", choices=SPLITS, help="only this split")
    parser.add_argument("--dir", type=Path, help="a task set directory (default: the shipped)")
    parser.add_argument(
        "--terminal-bench", type=Path, help="add the Terminal-Bench tasks under this directory"
    )
    parser.add_argument("--json", action="store_true", help="one JSON agent view per line")
    args = parser.parse_args(argv)
    if not (args.list or args.json):
        parser.error("nothing to do: give --list or --json")
    try:
        taskset = load_taskset(args.dir)
        if args.terminal_bench is not None:
            from clawrl.environments.terminal_bench import load_tasks

            converted = load_tasks(args.terminal_bench)
            for skip in converted.skipped:
                print(f"skipped {skip.name}: {skip.reason}", file=sys.stderr)
            taskset = TaskSet.of([*taskset.tasks, *converted.tasks])
    except TaskSetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    splits = [args.split] if args.split else list(SPLITS)
    tasks = [t for t in taskset.tasks if t.split in splits]
    if args.json:
        for task in tasks:
            print(json.dumps(task.agent_view()))
        return 0
    width = max(len(t.id) for t in taskset.tasks)
    for task in tasks:
        print(f"{task.id:<{width}}  {task.family:<16}  {task.split}")
    print()
    print("\n".join(_table(taskset.counts(), splits)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
