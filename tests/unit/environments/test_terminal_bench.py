"""The Terminal-Bench loader on task directories written here in that format: the ones the
sandbox can host convert into Tasks whose checker runs their run-tests.sh (verified both ways
on the host), and every other kind is skipped with its reason."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from clawrl.environments.tasks import TaskSetError, check_task, load_taskset
from clawrl.environments.tasks import main as tasks_main
from clawrl.environments.terminal_bench import (
    DEFAULT_TOOLS,
    Unsupported,
    load_task_dir,
    load_tasks,
    main,
)

TASK_YAML = """\
# a made-up task in Terminal-Bench's layout
instruction: |-
  {instruction}
author_name: clawrl tests
author_email: tests@example.org
difficulty: easy
category: file-operations
tags:
  - files
parser_name: pytest
max_agent_timeout_sec: 120.0
max_test_timeout_sec: 30.0
run_tests_in_same_shell: {same_shell}
"""
DOCKERFILE = """\
FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624

WORKDIR /app
"""
COMPOSE = """\
services:
  client:
    build:
      dockerfile: Dockerfile
    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
    container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}
    command: [ "sh", "-c", "sleep infinity" ]
    environment:
      - TEST_DIR=${T_BENCH_TEST_DIR}
    volumes:
      - ${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}
      - ${T_BENCH_TASK_AGENT_LOGS_PATH}:${T_BENCH_CONTAINER_AGENT_LOGS_PATH}
"""
RUN_TESTS = """\
#!/bin/bash
# the harness puts this file and the contents of tests/ in $TEST_DIR
bash "$TEST_DIR/check.sh"
"""


def make_task(root: Path, name: str, files: dict[str, str], **fields: str) -> Path:
    """A task directory: task.yaml, Dockerfile, docker-compose.yaml and run-tests.sh by default;
    `files` adds to or replaces them (an empty text deletes one)."""
    task_dir = root / name
    defaults = {
        "task.yaml": TASK_YAML.format(
            instruction=fields.get("instruction", "Do the thing."),
            same_shell=fields.get("same_shell", "false"),
        ),
        "Dockerfile": DOCKERFILE,
        "docker-compose.yaml": COMPOSE,
        "run-tests.sh": RUN_TESTS,
    }
    for rel, text in {**defaults, **files}.items():
        if not text:
            continue
        path = task_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".sh"):
            path.chmod(0o755)
    return task_dir


def greeting(root: Path) -> Path:
    """Converts: a base image, a test script in tests/, a solution.sh."""
    return make_task(
        root,
        "make-greeting",
        {
            "tests/check.sh": '#!/bin/bash\n[ "$(cat hello.txt)" = "Hello, world!" ]\n',
            "solution.sh": "#!/bin/bash\necho 'Hello, world!' > hello.txt\n",
        },
        instruction="Create /app/hello.txt containing the line: Hello, world!",
    )


# Bytes a checker must carry exactly: quotes, a backslash, no final newline.
EXPECTED = 'total: 12\nit\'s "done" \\o/'


# Two keystroke steps in solution.yaml's shape; the second writes EXPECTED's last line.
SOLUTION_YAML = r"""- command: |-
    printf '%s\n' "total: $(awk -F, '{s += $2} END {print s}' data.csv)" > report.txt
  min_timeout_sec: 0.1
- command: |-
    printf '%s' "it's \"done\" \\o/" >> report.txt
"""


def column_sum(root: Path) -> Path:
    """Converts: COPY seeds the workspace, tests/ has a nested data file, solution.yaml."""
    return make_task(
        root,
        "sum-column",
        {
            "Dockerfile": DOCKERFILE + "COPY data.csv ./\nCOPY inputs /app/inputs\n",
            "data.csv": "a,5\nb,7\n",
            "inputs/note.txt": "read me\n",
            "run-tests.sh": (
                "#!/bin/bash\nset -e\n"
                "total=$(awk -F, '{s += $2} END {print s}' data.csv)\n"
                '[ "$total" = 12 ]\n'
                'cmp -s "$TEST_DIR/expected/report.txt" report.txt\n'
            ),
            "tests/expected/report.txt": EXPECTED,
            "solution.yaml": SOLUTION_YAML,
        },
    )


def test_a_plain_task_converts_and_its_checker_runs_its_tests(tmp_path: Path) -> None:
    task = load_task_dir(greeting(tmp_path / "tasks"))
    assert (task.id, task.family, task.split) == (
        "terminal_bench.make-greeting",
        "terminal_bench",
        "heldout",
    )
    assert task.instruction == "Create /app/hello.txt containing the line: Hello, world!"
    assert (task.workdir, task.files) == ("/app", {})
    assert (task.checker_timeout_s, task.command_timeout_s) == (30.0, 60.0)
    assert set(DEFAULT_TOOLS) <= set(task.tools)
    assert "Hello, world!" in task.checker and "Hello, world!" not in str(
        task.agent_view()["tools"]
    )
    assert check_task(task, tmp_path / "check") == []


def test_copied_files_seed_the_workspace_and_test_files_keep_every_byte(tmp_path: Path) -> None:
    task = load_task_dir(column_sum(tmp_path / "tasks"), split="train")
    assert task.split == "train"
    assert task.files == {"data.csv": "a,5\nb,7\n", "inputs/note.txt": "read me\n"}
    assert task.solution.count("\n") == 2  # solution.yaml's two commands, one per line
    assert check_task(task, tmp_path / "check") == []
    # A report off by the final newline fails: the test file was written byte for byte.
    wrong = task.model_copy(update={"solution": task.solution + "echo >> report.txt\n"})
    problems = check_task(wrong, tmp_path / "wrong")
    assert problems and problems[-1].startswith("checker fails the solution (exit 1)")


SKIPS = {
    "downloads-pytest": (
        {"run-tests.sh": "#!/bin/bash\ncurl -LsSf https://astral.sh/uv/install.sh | sh\n"},
        "needs the network (curl in run-tests.sh)",
    ),
    "custom-image": (
        {"Dockerfile": DOCKERFILE + "RUN apt-get update && apt-get install -y jq\n"},
        "its Dockerfile runs RUN, so it needs a custom image",
    ),
    "with-database": (
        {"docker-compose.yaml": COMPOSE + "  db:\n    image: postgres:16\n"},
        "needs 2 services (client, db)",
    ),
    "serves-a-port": (
        {"docker-compose.yaml": COMPOSE + "    ports:\n      - 8080:8080\n"},
        "its service sets ports (network or host access)",
    ),
    "mounts-the-host": (
        {"docker-compose.yaml": COMPOSE + "      - ./data:/data\n"},
        "its service mounts './data:/data'",
    ),
    "no-run-tests": (
        {"run-tests.sh": ""},
        "no run-tests.sh (the default runs pytest, which needs an image)",
    ),
    "python-base": (
        {"Dockerfile": "FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\nWORKDIR /app\n"},
        "base image ghcr.io/laude-institute/t-bench/python-3-13 needs python3, not offered",
    ),
    "absolute-tests": (
        {"run-tests.sh": "#!/bin/bash\nbash /tests/check.sh\n"},
        "run-tests.sh names /tests literally instead of $TEST_DIR",
    ),
    "copies-outside": (
        {"Dockerfile": DOCKERFILE + "COPY data.csv /etc/data.csv\n", "data.csv": "x\n"},
        "COPY to /etc/data.csv, outside the workspace /app",
    ),
    "no-solution": ({"solution.sh": ""}, "no solution.sh or solution.yaml"),
    "bad-timeout": (
        {
            "task.yaml": TASK_YAML.format(instruction="x", same_shell="false").replace(
                "30.0", "soon"
            )
        },
        "task.yaml: max_test_timeout_sec is 'soon', not a positive number of seconds",
    ),
}


def test_tasks_the_sandbox_cannot_host_are_skipped_with_their_reason(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    greeting(root)
    for name, (files, _) in SKIPS.items():
        base = {"tests/check.sh": "#!/bin/bash\ntrue\n", "solution.sh": "#!/bin/bash\ntrue\n"}
        make_task(root, name, {**base, **files})
    make_task(root, "same-shell", {"solution.sh": "true\n"}, same_shell="true")
    (root / "not-a-task").mkdir()  # no task.yaml: not a task directory at all
    result = load_tasks(root)
    assert [t.id for t in result.tasks] == ["terminal_bench.make-greeting"]
    reasons = {s.name: s.reason for s in result.skipped}
    assert reasons == {
        **{name: reason for name, (_, reason) in SKIPS.items()},
        "same-shell": "its tests run in the agent's own shell session",
    }
    assert [s.name for s in result.skipped] == sorted(reasons)


def test_offering_python3_lets_a_python_task_convert(tmp_path: Path, monkeypatch) -> None:
    # This interpreter's real binary as python3 (a pyenv shim is a script needing more tools).
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    task_dir = make_task(
        tmp_path,
        "python-check",
        {
            "Dockerfile": "FROM python:3.13-slim-bookworm\nWORKDIR /app\n",
            "run-tests.sh": '#!/bin/bash\npython3 "$TEST_DIR/check.py"\n',
            "tests/check.py": "import sys\nsys.exit(open('out.txt').read() != '42\\n')\n",
            "solution.sh": "echo 42 > out.txt\n",
        },
    )
    with pytest.raises(Unsupported, match="needs python3"):
        load_task_dir(task_dir)
    task = load_task_dir(task_dir, tools=(*DEFAULT_TOOLS, "python3"))
    assert "python3" in task.tools
    assert check_task(task, tmp_path / "check") == []


def test_the_scan_reads_commands_not_here_documents_or_comments(tmp_path: Path) -> None:
    tools = ("sh", "bash", "cat", "mkdir", "mktemp", "chmod", "rm")
    script = (
        "#!/bin/bash\n# curl is only mentioned here\n"
        "cat > notes.txt <<'EOF'\nwget http://example.org\nEOF\n"
        "if [ -f notes.txt ]; then cat notes.txt; fi\n"
    )
    task_dir = make_task(tmp_path, "quiet", {"run-tests.sh": script, "solution.sh": "true\n"})
    assert load_task_dir(task_dir, tools=tools).tools[:2] == ("sh", "bash")
    (task_dir / "run-tests.sh").write_text(script + "grep -q x notes.txt && echo ok\n")
    with pytest.raises(Unsupported, match=r"needs grep \(run-tests.sh\), which the sandbox"):
        load_task_dir(task_dir, tools=tools)


def test_a_directory_without_tasks_is_an_error_and_the_cli_reports(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskSetError, match=r"none has task\.yaml"):
        load_tasks(tmp_path / "empty")
    root = tmp_path / "tasks"
    greeting(root)
    make_task(root, "custom-image", {"Dockerfile": DOCKERFILE + "RUN true\n"})
    assert main([str(root)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "converted  terminal_bench.make-greeting",
        "skipped    custom-image: its Dockerfile runs RUN, so it needs a custom image",
        "1 converted, 1 skipped",
    ]
    assert main([str(tmp_path / "empty")]) == 2


def test_the_task_list_cli_adds_converted_tasks_to_the_shipped_set(tmp_path: Path, capsys) -> None:
    root = tmp_path / "tasks"
    greeting(root)
    make_task(root, "custom-image", {"Dockerfile": DOCKERFILE + "RUN true\n"})
    assert tasks_main(["--list", "--split", "heldout", "--terminal-bench", str(root)]) == 0
    captured = capsys.readouterr()
    assert (
        captured.err
        == "skipped custom-image: its Dockerfile runs RUN, so it needs a custom image\n"
    )
    rows = [line.split() for line in captured.out.splitlines()]
    assert ["terminal_bench.make-greeting", "terminal_bench", "heldout"] in rows
    assert ["terminal_bench", "1"] in rows
    shipped = len(load_taskset().split("heldout"))
    assert rows[-1] == ["total", str(shipped + 1)]
