"""scripts/check_sizes.py, the size step of `make lint`: a file over 600 lines under services/ or
deploy/, or a function over 80 lines in services/, fails it; generated protobuf code and build
outputs do not count; and the repository passes it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("check_sizes", ROOT / "scripts/check_sizes.py")
check_sizes = importlib.util.module_from_spec(SPEC)
sys.modules["check_sizes"] = check_sizes
SPEC.loader.exec_module(check_sizes)


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def function(name: str, body_lines: int, indent: str = "") -> str:
    return f"{indent}def {name}():\n" + f"{indent}    x = 1\n" * (body_lines - 1)


def test_a_file_over_600_lines_fails(tmp_path, capsys):
    write(tmp_path, "services/svc/src/big.py", "x = 1\n" * 601)
    write(tmp_path, "deploy/fine.py", "x = 1\n" * 600)
    assert check_sizes.main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "services/svc/src/big.py: 601 lines (at most 600)" in out
    assert "fine.py" not in out


def test_a_file_over_600_lines_in_deploy_fails_too(tmp_path):
    write(tmp_path, "deploy/local/big.py", "x = 1\n" * 700)
    assert check_sizes.problems(tmp_path) == ["deploy/local/big.py: 700 lines (at most 600)"]


def test_a_function_over_80_lines_in_services_fails_nested_or_not(tmp_path):
    method = "class A:\n" + function("method", 81, "    ")
    nested = "def outer():\n" + function("inner", 81, "    ") + "    return inner\n"
    write(tmp_path, "services/svc/a.py", method)
    write(tmp_path, "services/svc/b.py", nested + function("short", 80))
    assert check_sizes.problems(tmp_path) == [
        "services/svc/a.py:2 A.method: 81 lines (at most 80)",
        "services/svc/b.py:1 outer: 83 lines (at most 80)",
        "services/svc/b.py:2 outer.inner: 81 lines (at most 80)",
    ]


def test_functions_in_deploy_and_generated_or_built_files_do_not_count(tmp_path):
    write(tmp_path, "deploy/local/stack.py", function("main", 120))
    write(tmp_path, "services/common/proto/x_pb2.py", "x = 1\n" * 900)
    write(tmp_path, "services/common/proto/x_pb2_grpc.py", function("stub", 120))
    write(tmp_path, "services/gateway/build/lib/copy.py", "x = 1\n" * 900)
    write(tmp_path, "services/gateway/src/clawrl_gateway.egg-info/x.py", "x = 1\n" * 900)
    assert check_sizes.main(["--root", str(tmp_path)]) == 0


def test_the_repository_is_within_the_limits():
    assert check_sizes.problems(ROOT) == []
