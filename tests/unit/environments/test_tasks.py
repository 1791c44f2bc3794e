"""The task format and its loader: a family file loads into validated, frozen tasks, and every
kind of mistake is refused with an error that names the file, the task and the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from clawrl.environments.tasks import (
    Task,
    TaskSetError,
    load_taskset,
    main,
    parse_family,
)

GOOD = """
family = "demo"
description = "two tasks"

[defaults]
tools = ["sh", "touch"]
max_steps = 3
command_timeout_s = 5.0

[[tasks]]
id = "demo.b"
split = "train"
instruction = "Create an empty file named b.txt."
solution = "touch b.txt"
checker = "[ -f b.txt ]"

[[tasks]]
id = "demo.a"
split = "heldout"
instruction = "Create an empty file named a.txt."
solution = "touch a.txt"
checker = "[ -f a.txt ]"
max_steps = 5
[tasks.files]
"sub/readme.txt" = "hi\\n"
"""


def write_set(root: Path, **families: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in families.items():
        (root / f"{name}.toml").write_text(text)
    return root


def test_a_family_file_loads_with_defaults_and_per_task_overrides() -> None:
    tasks = parse_family(GOOD, "demo.toml")
    b, a = tasks
    assert (b.id, b.family, b.split, b.max_steps, b.tools) == (
        "demo.b",
        "demo",
        "train",
        3,
        ("sh", "touch"),
    )
    assert (a.max_steps, a.files, a.checker_timeout_s, a.workdir) == (
        5,
        {"sub/readme.txt": "hi\n"},
        10.0,
        None,
    )
    with pytest.raises(ValidationError):
        a.max_steps = 9  # frozen: one loaded set serves every episode


def test_a_set_is_sorted_by_id_whatever_the_order_of_files_and_tasks(tmp_path: Path) -> None:
    other = GOOD.replace("demo", "other")
    one = load_taskset(write_set(tmp_path / "one", z=GOOD, a=other))
    two = load_taskset(write_set(tmp_path / "two", a=GOOD, z=other))
    ids = ["demo.a", "demo.b", "other.a", "other.b"]
    assert [t.id for t in one.tasks] == [t.id for t in two.tasks] == ids
    assert [t.id for t in one.split("heldout")] == ["demo.a", "other.a"]
    assert one.counts() == {"demo": {"train": 1, "heldout": 1}, "other": {"train": 1, "heldout": 1}}
    assert one.get("other.b").instruction == "Create an empty file named b.txt."
    with pytest.raises(KeyError, match=r"no task 'demo\.c'"):
        one.get("demo.c")
    with pytest.raises(TaskSetError, match="unknown split 'test'; one of train, heldout"):
        one.split("test")


# (text in GOOD, its replacement, what the error says): one edit per kind of mistake.
BAD_EDITS = [
    ('"[ -f b.txt ]"\n', '"[ -f b.txt ]"\ncolour = "red"\n', "task demo.b: colour: unknown field"),
    (
        'split = "train"',
        'split = "test"',
        "task demo.b: split: Input should be 'train' or 'heldout'",
    ),
    ('checker = "[ -f b.txt ]"\n', "", "task demo.b: no checker"),
    ('id = "demo.a"', 'id = "demo.b"', "demo.toml: duplicate task id demo.b"),
    ('split = "heldout"', 'split = "train"', "demo.toml: family demo has no heldout task"),
    ('id = "demo.b"', 'id = "other.b"', "task other.b: id 'other.b' must start with its family"),
    ('"sub/readme.txt"', '"/etc/passwd"', "files: '/etc/passwd' is not a relative path inside"),
    ('"sub/readme.txt"', '"sub/../../x"', "files: 'sub/../../x' is not a relative path inside"),
    (
        '"sub/readme.txt" = "hi\\n"',
        '"sub" = ""\n"sub/x" = ""',
        "sub is both a file and a directory",
    ),
    ('tools = ["sh", "touch"]', 'tools = ["touch"]', "task demo.b: tools: must include sh"),
    ('tools = ["sh", "touch"]', 'tools = ["sh", "sh"]', "tools: sh listed twice"),
    (
        'tools = ["sh", "touch"]',
        'tools = ["sh", "rm -rf"]',
        "tools: 'rm -rf' is not a command name",
    ),
    ("max_steps = 3", "max_steps = 0", "max_steps: Input should be greater than or equal to 1"),
    ("command_timeout_s = 5.0", "command_timeout_s = -1.0", "command_timeout_s: Input should be"),
    ('"Create an empty file named b.txt."', '"   "', "task demo.b: instruction: must not be blank"),
    ('solution = "touch b.txt"\n', "", "task demo.b: solution: Field required"),
    ("[defaults]", '[defaults]\nsplit = "train"', "[defaults] cannot set 'split'"),
    ('description = "two tasks"', 'descripton = "typo"', "demo.toml: unknown key 'descripton'"),
    ('family = "demo"', "", 'demo.toml: `family = "..."` is missing'),
    ('family = "demo"', 'family = "Demo Set"', "family: 'Demo Set' is not a family name"),
    ('[[tasks]]\nid = "demo.b"', '[[tasks]]\nfamily = "x"\nid = "demo.b"', "family is set once"),
    ('"[ -f b.txt ]"\n', '"[ -f b.txt ]"\nworkdir = "app"\n', "workdir: 'app' is not an absolute"),
    ("max_steps = 3", "max_steps = ", "demo.toml: not TOML"),
]


@pytest.mark.parametrize(("old", "new", "message"), BAD_EDITS)
def test_a_bad_family_file_is_refused_with_a_clear_error(old: str, new: str, message: str) -> None:
    assert old in GOOD
    with pytest.raises(TaskSetError, match=re.escape(message)):
        parse_family(GOOD.replace(old, new, 1), "demo.toml")


def test_an_oversized_workspace_is_refused() -> None:
    big = "x" * (64 * 1024 + 1)
    text = GOOD.replace('"sub/readme.txt" = "hi\\n"', f'"big.txt" = "{big}"')
    with pytest.raises(TaskSetError, match=r"big\.txt: 65537 bytes, over the 65536 allowed"):
        parse_family(text, "demo.toml")


def test_a_set_refuses_a_family_twice_and_an_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(TaskSetError, match=r"family demo is also defined in .*/a\.toml"):
        load_taskset(write_set(tmp_path / "twice", a=GOOD, b=GOOD))
    with pytest.raises(TaskSetError, match=r"no \*\.toml family files"):
        load_taskset(write_set(tmp_path / "empty"))
    with pytest.raises(TaskSetError, match="no such task set directory"):
        load_taskset(tmp_path / "missing")


def test_a_task_built_in_code_is_validated_the_same_way() -> None:
    fields = dict(
        id="demo.x", family="demo", split="train", instruction="Do it.", tools=["sh"],
        max_steps=2, command_timeout_s=1, checker="true", solution="true",
    )  # fmt: skip
    assert Task(**fields).tools == ("sh",)
    with pytest.raises(ValidationError, match=r"Extra inputs are not permitted"):
        Task(**fields, secret="x")


def test_the_cli_reports_a_bad_set_and_exits_2(tmp_path: Path, capsys) -> None:
    root = write_set(tmp_path / "bad", demo=GOOD.replace('split = "train"', 'split = "test"'))
    assert main(["--list", "--dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "demo.toml: task demo.b: split: Input should be" in err
    good = write_set(tmp_path / "good", demo=GOOD)
    assert main(["--list", "--dir", str(good)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["demo.a", "demo", "heldout"]
    assert out[-1].split() == ["total", "1", "1"]
