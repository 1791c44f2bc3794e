"""Judge prompts: middle-shortening with a visible marker, role-aware sections."""

from __future__ import annotations

from clawrl.judge.prompts import (
    MARKER,
    Budget,
    hint_messages,
    judge_input,
    prm_messages,
    render_message,
    shorten_middle,
)


def test_shorten_middle_keeps_both_ends_and_says_how_much_went() -> None:
    text = "A" * 500 + "B" * 500
    short, cut = shorten_middle(text, 200)
    assert cut and len(short) <= 200
    assert short.startswith("A") and short.endswith("B")
    head, tail = short.split(MARKER.split("{n}")[0])
    omitted = int(tail.split(" ", 1)[0])
    assert len(head) + omitted + len(tail.split("omitted ...]\n", 1)[1]) == len(text)
    assert shorten_middle("short", 200) == ("short", False)
    assert shorten_middle("x" * 200, 200) == ("x" * 200, False)


def test_render_message_shows_tool_calls() -> None:
    message = {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [{"function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}],
    }
    assert render_message(message) == 'Let me check.\n<tool_call> weather({"city": "Oslo"})'
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert render_message(parts) == "ab"


def test_judge_input_sections_roles_and_counts() -> None:
    messages = [{"role": "user", "content": f"old {i}"} for i in range(6)]
    state = [
        {"role": "tool", "name": "search", "content": "x" * 5000},
        {"role": "user", "content": "no, I meant the other one"},
    ]
    data = judge_input(messages, {"role": "assistant", "content": "R" * 9000}, state, Budget())
    assert "old 0" not in data.context and "old 2" in data.context and "old 5" in data.context
    assert "[TOOL RESULT (search)]" in data.next_state and "[USER]\nno, I meant" in data.next_state
    assert data.next_state.index("TOOL RESULT") < data.next_state.index("[USER]")
    assert data.shortened == 2  # the tool output and the reply
    prm = prm_messages(data)[1]["content"]
    assert "\\boxed{1}" in prm and "\\boxed{-1}" in prm and "\\boxed{0}" in prm
    assert "no, I meant" in prm
    hint = hint_messages(data)[1]["content"]
    assert "[HINT_START]" in hint and "[HINT_END]" in hint
    empty = judge_input([], {"role": "assistant", "content": ""}, [], Budget(context_messages=0))
    assert (empty.context, empty.response, empty.next_state) == ("(none)", "(empty)", "(none)")


def test_halved_budget_shrinks_but_stays_usable() -> None:
    budget = Budget(4, 2000, 4000).halved()
    assert (budget.message_chars, budget.response_chars) == (1000, 2000)
    assert Budget(4, 100, 100).halved().message_chars == 64
