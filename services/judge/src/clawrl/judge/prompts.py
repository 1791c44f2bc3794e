"""The judge's prompts as pure functions: the PRM prompt (did the reply fulfil the user's
intent, with the next state as evidence, role-aware) and the hint prompt, built from a turn's
messages with long parts shortened in the middle behind a visible marker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from clawrl.common.chat import content_text

MARKER = "\n[... {n} characters omitted ...]\n"


@dataclass(frozen=True)
class Budget:
    """Character limits of the parts of a judge prompt."""

    context_messages: int = 4
    message_chars: int = 2000
    response_chars: int = 4000

    def halved(self) -> Budget:
        return Budget(
            self.context_messages, max(self.message_chars // 2, 64), self.response_chars // 2
        )


def shorten_middle(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` cut to about `max_chars` by dropping its middle behind a marker that says how much
    was dropped (beginning and end are what a judge needs); (text, was_shortened)."""
    if len(text) <= max_chars:
        return text, False
    keep = max(max_chars - len(MARKER) - 8, 2)
    head, tail = keep // 2, keep - keep // 2
    omitted = len(text) - head - tail
    return text[:head] + MARKER.format(n=omitted) + text[len(text) - tail :], True


def _safe_text(content: Any) -> str:
    try:
        return content_text(content)
    except ValueError:
        return orjson.dumps(content).decode()


def render_message(message: dict[str, Any]) -> str:
    """A message as plain text for a judge: its content, plus its tool calls as JSON."""
    text = _safe_text(message.get("content"))
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        text += f"\n<tool_call> {function.get('name', '?')}({function.get('arguments', '')})"
    return text.strip()


ROLE_LABELS = {"user": "USER", "assistant": "ASSISTANT", "tool": "TOOL RESULT", "system": "SYSTEM"}


def _label(message: dict[str, Any]) -> str:
    role = str(message.get("role", "?"))
    label = ROLE_LABELS.get(role, role.upper())
    if role == "tool" and message.get("name"):
        label += f" ({message['name']})"
    return label


@dataclass(frozen=True)
class JudgeInput:
    """The three sections of every judge prompt, already shortened; `shortened` counts the
    parts that were cut."""

    context: str
    response: str
    next_state: str
    shortened: int


def judge_input(
    messages: Sequence[dict[str, Any]],
    response_message: dict[str, Any],
    next_state: Sequence[dict[str, Any]],
    budget: Budget,
) -> JudgeInput:
    """Sections for a judge prompt: the last `context_messages` messages before the reply, the
    reply, and every next-state message with its role."""
    shortened = 0
    context_lines = []
    recent = list(messages)[-budget.context_messages :] if budget.context_messages else []
    for message in recent:
        text, cut = shorten_middle(render_message(message), budget.message_chars)
        shortened += cut
        context_lines.append(f"[{_label(message)}]\n{text}")
    response, cut = shorten_middle(render_message(response_message), budget.response_chars)
    shortened += cut
    state_lines = []
    for message in next_state:
        text, cut = shorten_middle(render_message(message), budget.message_chars)
        shortened += cut
        state_lines.append(f"[{_label(message)}]\n{text}")
    return JudgeInput(
        context="\n\n".join(context_lines) or "(none)",
        response=response or "(empty)",
        next_state="\n\n".join(state_lines) or "(none)",
        shortened=shortened,
    )


PRM_SYSTEM = (
    "You are a careful process reward model. You decide whether an AI assistant's reply "
    "fulfilled the user's intent, using what happened right after the reply as evidence."
)

PRM_TASK = """Judge the ASSISTANT'S REPLY, using WHAT CAME NEXT as evidence.
- A USER message that came next is feedback on the reply. Thanks or approval means the reply \
was good. Asking for a redo, correcting it ("no, I meant ..."), complaining, or rephrasing the \
same request means it was bad. Moving on to an unrelated request says nothing about the reply.
- A TOOL RESULT that came next exists because the assistant called that tool. A successful, \
useful result means the call was good. An error caused by the call (wrong tool, bad or missing \
arguments) means it was bad.
- If the evidence does not show either, the verdict is neutral.
Think briefly, then end your answer with exactly one of \\boxed{1} (good), \\boxed{-1} (bad) \
or \\boxed{0} (neutral)."""

HINT_SYSTEM = (
    "You extract hindsight hints. Looking at what happened after an AI assistant's reply, you "
    "decide whether it reveals how the reply should have been written."
)

HINT_TASK = """Does WHAT CAME NEXT tell how the ASSISTANT'S REPLY should have been different \
(a correction, a stated preference, a missing requirement, an error the reply caused)?
- If yes: answer \\boxed{1}, then write a hint of 1 to 3 sentences addressed to the assistant, \
as an instruction it could have been given before replying, between [HINT_START] and \
[HINT_END]. Example: \\boxed{1} [HINT_START]Answer with the number only.[HINT_END]
- If no (the reply was fine, or nothing useful can be learned): answer \\boxed{-1}."""


def _sections(data: JudgeInput) -> str:
    return (
        f"## CONVERSATION BEFORE THE REPLY\n{data.context}\n\n"
        f"## ASSISTANT'S REPLY\n{data.response}\n\n"
        f"## WHAT CAME NEXT\n{data.next_state}\n\n"
    )


def prm_messages(data: JudgeInput) -> list[dict[str, str]]:
    """Chat messages asking for a PRM verdict (`\\boxed{1|-1|0}`)."""
    return [
        {"role": "system", "content": PRM_SYSTEM},
        {"role": "user", "content": _sections(data) + PRM_TASK},
    ]


def hint_messages(data: JudgeInput) -> list[dict[str, str]]:
    """Chat messages asking for a hint vote (`\\boxed{1|-1}` + `[HINT_START]...[HINT_END]`)."""
    return [
        {"role": "system", "content": HINT_SYSTEM},
        {"role": "user", "content": _sections(data) + HINT_TASK},
    ]


PRM_YES_NO_TASK = """Judge the ASSISTANT'S REPLY, using WHAT CAME NEXT as evidence.
- A USER message that came next is feedback on the reply. Thanks or approval means the reply was \
good. Asking for a redo, correcting it ("no, I meant ..."), complaining, or rephrasing the same \
request means it was bad.
- A TOOL RESULT that came next exists because the assistant called that tool. A successful, \
useful result means the call was good. An error caused by the call (wrong tool, bad or missing \
arguments) means it was bad.
Was the reply good? Answer with one word: Yes or No."""


def prm_yes_no_messages(data: JudgeInput) -> list[dict[str, str]]:
    """Chat messages asking for a one-word Yes/No PRM answer, read from the first answer
    token's log-probs (judging.prm = logprob), not sampled."""
    return [
        {"role": "system", "content": PRM_SYSTEM},
        {"role": "user", "content": _sections(data) + PRM_YES_NO_TASK},
    ]
