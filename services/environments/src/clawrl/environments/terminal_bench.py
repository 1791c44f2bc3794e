"""Terminal-Bench task directories as clawrl `Task`s, for the tasks a sandbox can host as it is.

A Terminal-Bench (v1) task is a directory: `task.yaml` (the `instruction`, timeouts, metadata),
a Docker environment (`Dockerfile` and/or `docker-compose.yaml`), `run-tests.sh` with its
`tests/`, and `solution.sh` (or `solution.yaml`). Its harness copies `run-tests.sh` and the
contents of `tests/` into `/tests` after the agent is done, runs `bash /tests/run-tests.sh` in
the container's working directory with `TEST_DIR=/tests`, and reads the verdict.

A sandbox here has no image of its own beyond a list of host tools and no network, so a task
converts only when its Dockerfile is a base image plus `WORKDIR` and `COPY`s of task files (the
copies become seeded workspace files), its compose file has that one service and nothing that
reaches out (ports, extra services, host mounts), and its scripts call only offered tools and
nothing that downloads. Everything else is reported as skipped, with the reason. The checker
of a converted task writes run-tests.sh and the test files into a fresh temporary directory
(the agent never sees them), runs it there with `TEST_DIR` set, and returns its exit status.

    python -m clawrl.environments.terminal_bench DIR [--split heldout] [--tools sh,ls,...]
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import ValidationError

from clawrl.environments.tasks import (
    MAX_FILE_BYTES,
    SPLITS,
    Task,
    TaskSetError,
    format_validation_error,
)

log = logging.getLogger(__name__)

FAMILY = "terminal_bench"

# What a converted task's agent and checker get when the caller names no tools: a POSIX
# userland plus bash (run-tests.sh is a bash script by convention).
DEFAULT_TOOLS = (
    "sh", "bash", "ls", "cat", "echo", "printf", "touch", "mkdir", "rm", "rmdir", "cp", "mv",
    "ln", "chmod", "find", "grep", "sed", "awk", "sort", "uniq", "cut", "tr", "wc", "head",
    "tail", "tee", "diff", "cmp", "xargs", "basename", "dirname", "mktemp", "seq", "paste",
    "date", "env", "sleep", "true", "false", "test",
)  # fmt: skip
# The checker's own needs: unpack the tests, run them, clean up.
CHECKER_TOOLS = ("sh", "bash", "mkdir", "mktemp", "chmod", "rm")

# Commands that only make sense with a network (downloads, package installs, remote shells).
NETWORK_COMMANDS = frozenset(
    "curl wget pip pip3 uv uvx apt apt-get apk yum dnf npm npx yarn pnpm ssh scp rsync nc "
    "ping git docker".split()
)
# Base images whose userland the sandbox's host tools stand in for, and what each adds.
BASE_IMAGES = {
    "ghcr.io/laude-institute/t-bench/ubuntu-24-04": (),
    "ghcr.io/laude-institute/t-bench/python-3-13": ("python3",),
    "ubuntu": (),
    "debian": (),
    "python": ("python3",),
}
# Words that lead up to a command (the next word is the command) ...
_PREFIX_WORDS = frozenset("! { if then else elif do while until time exec command builtin".split())
# ... and sh/bash keywords and builtins, which need no host tool (the rest of the segment is
# their arguments, or a loop/case header, or a function definition).
_SHELL_WORDS = frozenset(
    "} [[ ]] fi for in done case esac function select . : [ alias break cd continue declare "
    "echo eval exit export false getopts hash local printf pushd popd pwd read readonly return "
    "set shift source test trap true type typeset ulimit umask unalias unset wait let shopt".split()
)
# Compose service keys that mean the task needs more than one isolated, offline shell.
_SERVICE_BLOCKERS = (
    "ports", "expose", "network_mode", "networks", "privileged", "cap_add", "devices",
    "depends_on", "links", "extra_hosts", "runtime", "ipc", "pid",
)  # fmt: skip
_TB_VOLUME = re.compile(r"^\$\{T_BENCH_[A-Z_]+\}:")
MAX_TEST_BYTES = 256 * 1024
# Terminal-Bench limits an episode by time only; a step limit keeps a looping agent bounded.
DEFAULT_MAX_STEPS = 30


class Unsupported(Exception):
    """A task the sandbox cannot host; the message is the reason."""


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


@dataclass(frozen=True)
class Conversion:
    """The tasks that converted, by id, and the ones skipped, by directory name."""

    tasks: tuple[Task, ...]
    skipped: tuple[Skipped, ...] = field(default_factory=tuple)


def load_tasks(
    root: Path, *, tools: Sequence[str] = DEFAULT_TOOLS, split: str = "heldout"
) -> Conversion:
    """Every task directory under `root` (a directory holding `task.yaml`), converted or
    skipped. Terminal-Bench is an evaluation set, so its tasks default to the held-out split."""
    if not root.is_dir():
        raise TaskSetError(f"{root}: no such directory")
    tasks, skipped = [], []
    for task_dir in sorted(p for p in root.iterdir() if (p / "task.yaml").is_file()):
        try:
            tasks.append(load_task_dir(task_dir, tools=tools, split=split))
        except Unsupported as exc:
            reason = str(exc)
            log.info("terminal-bench task skipped", extra={"task": task_dir.name, "reason": reason})
            skipped.append(Skipped(task_dir.name, reason))
    if not tasks and not skipped:
        raise TaskSetError(f"{root}: no Terminal-Bench task directories (none has task.yaml)")
    return Conversion(tuple(sorted(tasks, key=lambda t: t.id)), tuple(skipped))


def load_task_dir(
    task_dir: Path, *, tools: Sequence[str] = DEFAULT_TOOLS, split: str = "heldout"
) -> Task:
    """One task directory as a Task; Unsupported(reason) when the sandbox cannot host it."""
    if split not in SPLITS:
        raise TaskSetError(f"unknown split {split!r}; one of {', '.join(SPLITS)}")
    config = _task_config(task_dir)
    if config.get("run_tests_in_same_shell"):
        raise Unsupported("its tests run in the agent's own shell session")
    image, workdir, files = _environment(task_dir)
    missing = [t for t in BASE_IMAGES[image] if t not in tools]
    if missing:
        raise Unsupported(f"base image {image} needs {', '.join(missing)}, not offered")
    run_tests = _text(task_dir / "run-tests.sh", "run-tests.sh")
    tests = _test_files(task_dir / "tests")
    solution = _solution(task_dir)
    scripts = {"run-tests.sh": run_tests, "solution": solution}
    scripts |= {f"tests/{p}": text for p, (text, _) in tests.items() if p.endswith(".sh")}
    for name, text in scripts.items():
        _check_commands(text, name, tools)
    if re.search(r"(?<![\w$}])/tests\b", run_tests):
        raise Unsupported("run-tests.sh names /tests literally instead of $TEST_DIR")
    task_tools = tuple(dict.fromkeys([*tools, *CHECKER_TOOLS]))
    try:
        return Task(
            id=f"{FAMILY}.{_slug(task_dir.name)}",
            family=FAMILY,
            split=split,
            instruction=str(config["instruction"]),
            files=files,
            tools=task_tools,
            max_steps=DEFAULT_MAX_STEPS,
            command_timeout_s=min(_seconds(config, "max_agent_timeout_sec", 360.0), 60.0),
            checker=_checker(task_dir.name, run_tests, tests),
            checker_timeout_s=min(_seconds(config, "max_test_timeout_sec", 60.0), 600.0),
            solution=solution,
            workdir=workdir,
        )
    except ValidationError as exc:
        raise Unsupported(f"does not fit the task format: {format_validation_error(exc)}") from exc


def _seconds(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise Unsupported(f"task.yaml: {key} is {value!r}, not a positive number of seconds")
    return float(value)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9_.-]", "-", name.lower()).strip(".-") or "task"


def _text(path: Path, what: str, limit: int = MAX_FILE_BYTES) -> str:
    if not path.is_file():
        if what == "run-tests.sh":
            raise Unsupported("no run-tests.sh (the default runs pytest, which needs an image)")
        raise Unsupported(f"no {what}")
    data = path.read_bytes()
    if len(data) > limit:
        raise Unsupported(f"{what} is {len(data)} bytes, over {limit}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unsupported(f"{what} is not UTF-8 text") from exc
    if "\0" in text:
        raise Unsupported(f"{what} is binary")
    return text


def _task_config(task_dir: Path) -> dict[str, Any]:
    try:
        config = yaml.safe_load((task_dir / "task.yaml").read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise Unsupported(f"task.yaml does not parse: {exc}") from exc
    if not isinstance(config, dict):
        raise Unsupported("task.yaml is not a mapping")
    instruction = config.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise Unsupported("task.yaml has no instruction")
    return config


def _environment(task_dir: Path) -> tuple[str, str | None, dict[str, str]]:
    """(base image, WORKDIR, seeded files) of a task whose environment the sandbox can stand
    in for; Unsupported otherwise."""
    names = ("docker-compose.yaml", "docker-compose.yml")
    compose = next((task_dir / n for n in names if (task_dir / n).is_file()), None)
    dockerfile = "Dockerfile"
    if compose is not None:
        service = _one_service(compose)
        build = service.get("build")
        if build is None:
            image = str(service.get("image", ""))
            return _base_image(image), None, {}
        context = build.get("context", ".") if isinstance(build, dict) else build
        if context not in (".", "./"):
            raise Unsupported("its image builds from another directory")
        if isinstance(build, dict):
            dockerfile = str(build.get("dockerfile", "Dockerfile"))
    path = task_dir / dockerfile
    if not path.is_file():
        raise Unsupported(f"no {dockerfile} (no Docker environment)")
    return _dockerfile(task_dir, path.read_text(encoding="utf-8"))


def _one_service(compose: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(compose.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise Unsupported(f"{compose.name} does not parse: {exc}") from exc
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict) or not services:
        raise Unsupported(f"{compose.name} has no services")
    if len(services) > 1:
        raise Unsupported(f"needs {len(services)} services ({', '.join(services)})")
    (service,) = services.values()
    if not isinstance(service, dict):
        raise Unsupported(f"{compose.name}: its service is not a mapping")
    for key in _SERVICE_BLOCKERS:
        if key in service:
            raise Unsupported(f"its service sets {key} (network or host access)")
    for volume in service.get("volumes", []) or []:
        # The harness's own log mounts are fine; anything else mounts the host.
        if not (isinstance(volume, str) and _TB_VOLUME.match(volume)):
            raise Unsupported(f"its service mounts {volume!r}")
    return service


def _base_image(image: str) -> str:
    ref = image.split("@")[0]
    name = ref.rsplit(":", 1)[0] if ":" in ref.rsplit("/", 1)[-1] else ref
    if name in BASE_IMAGES:
        return name
    raise Unsupported(f"image {image or '(none)'} is no base image the sandbox stands in for")


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        joined.append(current + stripped)
        current = ""
    if current:
        joined.append(current)
    out = []
    for line in joined:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _dockerfile(task_dir: Path, text: str) -> tuple[str, str | None, dict[str, str]]:
    image, workdir, files = None, None, {}
    for word, args in _instructions(text):
        if word == "FROM":
            if image is not None:
                raise Unsupported("its Dockerfile has several stages")
            image = _base_image(args.split()[0] if args else "")
        elif word == "WORKDIR":
            workdir = str(PurePosixPath(workdir or "/") / args)
        elif word == "COPY":
            files |= _copied(task_dir, shlex.split(args), workdir)
        elif word in ("CMD", "ENTRYPOINT", "LABEL", "MAINTAINER"):
            continue  # the harness overrides the command; labels change nothing
        else:
            raise Unsupported(f"its Dockerfile runs {word}, so it needs a custom image")
    if image is None:
        raise Unsupported("its Dockerfile has no FROM")
    return image, workdir, files


def _copied(task_dir: Path, args: list[str], workdir: str | None) -> dict[str, str]:
    """The workspace files of one `COPY src... dest`, which must land inside WORKDIR."""
    args = [a for a in args if not a.startswith("--chown=") and not a.startswith("--chmod=")]
    if any(a.startswith("--") for a in args) or len(args) < 2:
        raise Unsupported(f"COPY {' '.join(args)} is more than a copy of task files")
    *sources, dest = args
    if workdir is None:
        raise Unsupported("COPY before WORKDIR: the workspace has no place for it")
    target = PurePosixPath(workdir) / dest
    try:
        rel = target.relative_to(workdir)
    except ValueError:
        raise Unsupported(f"COPY to {target}, outside the workspace {workdir}") from None
    into_dir = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
    files = {}
    for source in sources:
        path = (task_dir / source).resolve()
        if not path.is_relative_to(task_dir.resolve()) or not path.exists():
            raise Unsupported(f"COPY {source}: not a file of the task")
        if path.is_dir():
            for item in sorted(p for p in path.rglob("*") if p.is_file()):
                name = rel / item.relative_to(path)
                files[str(name)] = _text(item, f"copied file {item.name}")
        else:
            name = rel / path.name if into_dir else rel
            files[str(name)] = _text(path, f"copied file {source}")
    return {str(PurePosixPath(p)): c for p, c in files.items()}


def _test_files(tests_dir: Path) -> dict[str, tuple[str, bool]]:
    """tests/ (relative path -> (text, executable)); text files only."""
    if not tests_dir.is_dir():
        return {}
    out, total = {}, 0
    for path in sorted(p for p in tests_dir.rglob("*") if p.is_file()):
        rel = str(path.relative_to(tests_dir))
        text = _text(path, f"tests/{rel}")
        total += len(text.encode())
        out[rel] = (text, bool(path.stat().st_mode & 0o111))
    if total > MAX_TEST_BYTES:
        raise Unsupported(f"tests/ holds {total} bytes, over {MAX_TEST_BYTES}")
    return out


def _solution(task_dir: Path) -> str:
    if (task_dir / "solution.sh").is_file():
        return _text(task_dir / "solution.sh", "solution.sh")
    if not (task_dir / "solution.yaml").is_file():
        raise Unsupported("no solution.sh or solution.yaml")
    try:
        steps = yaml.safe_load(_text(task_dir / "solution.yaml", "solution.yaml"))
    except yaml.YAMLError as exc:
        raise Unsupported(f"solution.yaml does not parse: {exc}") from exc
    if not isinstance(steps, list) or not all(
        isinstance(s, dict) and isinstance(s.get("command"), str) for s in steps
    ):
        raise Unsupported("solution.yaml is not a list of {command: ...} steps")
    return "\n".join(s["command"] for s in steps) + "\n"


def _command_words(script: str) -> Iterable[str]:
    """The first word of each simple command of a shell script, by a rough scan (no full
    parse): here-document bodies and comments are left out; a pattern of a `case` may pass
    for a command, which can only make a task skipped. A command it misses is still not on
    the sandbox's PATH, so that task fails its episodes rather than escaping."""
    heredoc = None
    for line in script.splitlines():
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        match = re.search(r"(?<!<)<<-?(?!<)\s*['\"]?([A-Za-z_]\w*)['\"]?", line)
        if match:
            heredoc = match.group(1)
        line = re.sub(r"(^|\s)#.*$", "", line)
        for segment in re.split(r"\|\||&&|[;|&()`]|\$\(", line):
            words = segment.split()
            while words and (words[0] in _PREFIX_WORDS or re.match(r"^\w+=", words[0])):
                words = words[1:]
            if words and words[0] not in _SHELL_WORDS:
                yield words[0]


def _check_commands(script: str, name: str, tools: Sequence[str]) -> None:
    """Unsupported when `script` calls a download tool or a command the sandbox lacks."""
    for word in _command_words(script):
        command = word.rsplit("/", 1)[-1] if word.startswith("/") else word
        if not re.match(r"^[A-Za-z][\w.+-]*$", command):
            continue  # a variable, a path to a script, a quoted word: not a host tool
        if command in NETWORK_COMMANDS:
            raise Unsupported(f"needs the network ({command} in {name})")
        if command not in tools:
            raise Unsupported(f"needs {command} ({name}), which the sandbox does not offer")


def _quoted(text: str) -> str:
    """`text` as one single-quoted sh word, byte for byte."""
    return "'" + text.replace("'", "'\\''") + "'"


def _checker(name: str, run_tests: str, tests: dict[str, tuple[str, bool]]) -> str:
    """A POSIX sh checker that lays out Terminal-Bench's /tests in a temporary directory (its
    harness copies run-tests.sh and the contents of tests/ side by side), runs run-tests.sh
    from the workspace as the harness does, and exits with its status."""
    lines = [
        f"# Terminal-Bench task {name}: its run-tests.sh and tests/, unpacked after the episode.",
        "t=$(mktemp -d) || exit 1",
    ]
    for rel, (text, executable) in {"run-tests.sh": (run_tests, True), **tests}.items():
        parent = str(PurePosixPath(rel).parent)
        if parent != ".":
            lines.append(f'mkdir -p "$t"/{_quoted(parent)}')
        lines.append(f'printf %s {_quoted(text)} > "$t"/{_quoted(rel)}')
        if executable:
            lines.append(f'chmod +x "$t"/{_quoted(rel)}')
    lines += [
        'TEST_DIR="$t" T_BENCH_TEST_DIR="$t" bash "$t/run-tests.sh"',
        "status=$?",
        'rm -rf "$t"',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clawrl.environments.terminal_bench",
        description="Convert Terminal-Bench task directories; list what converted and why the "
        "rest did not.",
    )
    parser.add_argument("root", type=Path, help="a directory of Terminal-Bench task directories")
    parser.add_argument("--split", choices=SPLITS, default="heldout")
    parser.add_argument("--tools", help="comma-separated tools the sandbox offers")
    args = parser.parse_args(argv)
    tools = tuple(args.tools.split(",")) if args.tools else DEFAULT_TOOLS
    try:
        result = load_tasks(args.root, tools=tools, split=args.split)
    except TaskSetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for task in result.tasks:
        print(f"converted  {task.id}")
    for skip in result.skipped:
        print(f"skipped    {skip.name}: {skip.reason}")
    print(f"{len(result.tasks)} converted, {len(result.skipped)} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
