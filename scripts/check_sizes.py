"""Size limits of the source, checked by `make lint`: no Python file under services/ or deploy/
over 600 lines, and no function in services/ over 80 lines (generated protobuf code aside).

A file past the limit is usually two modules sharing one name, and a long function two steps:
split along the seam the code already has (see STYLE.md). Prints each offender and exits 1.

    python scripts/check_sizes.py [--root DIR]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
FILE_ROOTS = ("services", "deploy")
FUNCTION_ROOTS = ("services",)
SKIPPED_DIRS = {"build", "dist", "__pycache__", "node_modules"}  # build outputs, not source

# Functions allowed past MAX_FUNCTION_LINES, as "path:qualified name" with the reason. None today;
# an entry needs a reason a reviewer accepts (a flat table, say), not "too hard to split".
ALLOWED_FUNCTIONS: dict[str, str] = {}


def sources(root: Path, top: str) -> Iterator[Path]:
    """The Python sources under root/top, but generated protobuf code and build outputs."""
    for path in sorted((root / top).rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if any(p in SKIPPED_DIRS or p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        if "_pb2" in path.name:  # protoc's output: *_pb2.py, *_pb2_grpc.py, *_pb2.pyi
            continue
        yield path


def long_functions(tree: ast.AST) -> Iterator[tuple[int, str, int]]:
    """(line, qualified name, length in lines) of every function and method, nested ones too;
    a function's length includes what is nested in it."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[int, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    yield child.lineno, name, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def problems(root: Path) -> list[str]:
    """Every file and function past its limit, one line each."""
    out = []
    for top in FILE_ROOTS:
        for path in sources(root, top):
            text = path.read_text(encoding="utf-8")
            name = path.relative_to(root).as_posix()
            lines = len(text.splitlines())
            if lines > MAX_FILE_LINES:
                out.append(f"{name}: {lines} lines (at most {MAX_FILE_LINES})")
            if top not in FUNCTION_ROOTS:
                continue
            for line, function, length in long_functions(ast.parse(text, filename=name)):
                if length > MAX_FUNCTION_LINES and f"{name}:{function}" not in ALLOWED_FUNCTIONS:
                    out.append(
                        f"{name}:{line} {function}: {length} lines (at most {MAX_FUNCTION_LINES})"
                    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parents[1], help="the repository"
    )
    args = parser.parse_args(argv)
    found = problems(args.root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} over the size limits: split along the seams the code already has")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
