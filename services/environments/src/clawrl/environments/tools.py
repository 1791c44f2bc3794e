"""The agent's tools in a sandbox: their OpenAI function schemas and how a result becomes the
observation (the tool message the model reads next). Pure functions, no I/O.

The names are OpenClaw-RL's terminal tools (camel's TerminalToolkit, as their pool server
lists them), so a policy trained on one reads the other: `shell_exec` runs a command and
`shell_write_content_to_file` writes a file. Their interactive pair (`shell_view`,
`shell_write_to_process`) is left out: every command here runs to its end or its timeout.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clawrl.environments.backend import WORKSPACE, ExecResult

SHELL_EXEC = "shell_exec"
WRITE_FILE = "shell_write_content_to_file"
TOOL_NAMES = (SHELL_EXEC, WRITE_FILE)


class ToolCallError(ValueError):
    """A tool call the service cannot run (unknown tool, missing or mistyped argument). The
    model made it, so it comes back as the observation, not as an HTTP error."""


@dataclass(frozen=True)
class Command:
    """A tool call turned into one sandbox command."""

    command: str
    stdin: bytes | None = None
    timeout_s: float | None = None


def tool_schemas() -> list[dict[str, Any]]:
    """The tools in OpenAI's function-tool form, as /reset returns them."""
    return [
        {
            "type": "function",
            "function": {
                "name": SHELL_EXEC,
                "description": "Run a shell command in the task's workspace (/workspace) and "
                "return its output and exit code. There is no network.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "description": "The shell command."},
                        "timeout": {
                            "type": "number",
                            "description": "Seconds before the command is killed (optional).",
                        },
                    },
                    "required": ["command"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": WRITE_FILE,
                "description": "Write text to a file in the workspace, replacing it.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "file_path": {"type": "string", "description": "Path of the file."},
                        "content": {"type": "string", "description": "The file's new text."},
                    },
                    "required": ["file_path", "content"],
                },
            },
        },
    ]


def workspace_path(path: str) -> str:
    """An absolute, normalised path inside the workspace; a relative path is taken from it.
    Raises ToolCallError for a path that leaves it (the sandbox would refuse it anyway)."""
    if not path or "\x00" in path:
        raise ToolCallError("file_path must be a non-empty path")
    full = posixpath.normpath(posixpath.join(WORKSPACE, path))
    if full != WORKSPACE and not full.startswith(WORKSPACE + "/"):
        raise ToolCallError(f"file_path {path!r} is outside {WORKSPACE}")
    return full


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def command_of(name: str, arguments: Mapping[str, Any]) -> Command:
    """The sandbox command a tool call runs. `shell_exec` accepts camel's extra arguments
    (`id`, `block`) and ignores them."""
    if name == SHELL_EXEC:
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ToolCallError("shell_exec needs a non-empty string argument 'command'")
        timeout = arguments.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise ToolCallError("shell_exec's 'timeout' must be a positive number")
        return Command(command, timeout_s=float(timeout) if timeout is not None else None)
    if name == WRITE_FILE:
        path, content = arguments.get("file_path"), arguments.get("content")
        if not isinstance(path, str) or not isinstance(content, str):
            raise ToolCallError(f"{WRITE_FILE} needs string arguments 'file_path' and 'content'")
        target = _quote(workspace_path(path))
        script = f'mkdir -p "$(dirname {target})" && cat > {target}'
        return Command(script, stdin=content.encode())
    raise ToolCallError(f"unknown tool {name!r}; the tools are {', '.join(TOOL_NAMES)}")


def observation(result: ExecResult) -> str:
    """The text the model reads: stdout, then stderr, then a status line when the command did
    not simply succeed (exit code, timeout, truncation), so a failure is never silent."""
    parts = [result.stdout]
    if result.stderr:
        parts.append(
            ("" if not result.stdout or result.stdout.endswith("\n") else "\n") + result.stderr
        )
    text = "".join(parts)
    notes = []
    if result.timed_out:
        notes.append(f"[killed: timed out after {result.duration_s:.1f}s]")
    elif result.exit_code != 0:
        notes.append(f"[exit code {result.exit_code}]")
    if result.limit:
        notes.append(f"[limit hit: {result.limit}]")
    if result.truncated:
        notes.append("[output truncated]")
    if notes:
        text = (text if not text or text.endswith("\n") else text + "\n") + " ".join(notes)
    return text if text else "[no output]"
