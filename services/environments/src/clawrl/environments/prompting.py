"""What the agent runner shows the model before a task's instruction: a system message and, by
default, five worked episodes (few-shot). Pure data and one function; no I/O.

Why the worked episodes (measured on SmolLM2-135M-Instruct through the gateway): with the
instruction alone it never called a tool (0 of 4 replies to "Create a file named hello.txt ...",
greedy and at 0.7: it wrote Python or bash in a code block). With these five, greedy replies to
every fifth task of the train split (15 tasks) were a parsed tool call in 9 of 15; with the
first three and without the sentence that opens each demo's call ("I will run a shell
command."), in 0 of 15 (it wrote `<tool_response>` where `<tool_call>` belongs, copying the tool
results' wrapper). The demos use
commands no task family is about (ls, date, cat, pwd), on files of their own: they teach the
call format, not a task's solution.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from clawrl.environments.tools import SHELL_EXEC

PromptStyle = Literal["few-shot", "plain"]
PROMPT_STYLES: tuple[PromptStyle, ...] = ("few-shot", "plain")

SYSTEM = (
    "You work in a Linux shell, in a directory that holds the task's files. Run commands with "
    "shell_exec. When the task is done, reply with a short message and no tool call."
)
CALL_PREFIX = "I will run a shell command."

# (instruction, command, its output as the tool message, the closing reply)
DEMOS = (
    (
        "Show the files in the current directory.",
        "ls",
        "notes.txt\nreport.md\n",
        "There are two files: notes.txt and report.md.",
    ),
    (
        "Save the current date to today.txt.",
        "date > today.txt",
        "[no output]",
        "Done: today.txt holds the date.",
    ),
    (
        "What does notes.txt say?",
        "cat notes.txt",
        "buy milk\ncall Bob\n",
        "notes.txt says: buy milk, call Bob.",
    ),
    ("Which directory am I in?", "pwd", "/workspace\n", "You are in /workspace."),
    (
        "List the files with their sizes.",
        "ls -l",
        "-rw-r--r-- 1 user user 18 notes.txt\n-rw-r--r-- 1 user user 42 report.md\n",
        "notes.txt has 18 bytes and report.md 42.",
    ),
)


def demo_messages() -> list[dict[str, Any]]:
    """The worked episodes as chat messages (OpenAI tool-call form)."""
    messages: list[dict[str, Any]] = []
    for index, (instruction, command, output, closing) in enumerate(DEMOS):
        call_id = f"call_demo{index}"
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": SHELL_EXEC, "arguments": json.dumps({"command": command})},
        }
        messages += [
            {"role": "user", "content": instruction},
            {"role": "assistant", "content": CALL_PREFIX, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": output},
            {"role": "assistant", "content": closing},
        ]
    return messages


def opening_messages(instruction: str, style: PromptStyle = "few-shot") -> list[dict[str, Any]]:
    """An episode's first request: the system message, the demos (few-shot) and the task's
    instruction as the user message."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; one of {', '.join(PROMPT_STYLES)}")
    demos = demo_messages() if style == "few-shot" else []
    return [
        {"role": "system", "content": SYSTEM},
        *demos,
        {"role": "user", "content": instruction},
    ]
