"""Hint votes, hint selection and hint injection as pure functions."""

from __future__ import annotations

from clawrl.judge.hints import HintVote, inject_hint, parse_hint_vote, select_hint


def test_parse_hint_vote() -> None:
    vote = parse_hint_vote("Yes. \\boxed{1} [HINT_START] Answer in French. [HINT_END]")
    assert vote == HintVote(score=1, hint="Answer in French.")
    assert parse_hint_vote("\\boxed{-1}") == HintVote(score=-1, hint="")
    # 0 is not a hint verdict; the last of several hints counts.
    assert parse_hint_vote("\\boxed{0}").score is None
    text = "[HINT_START]a[HINT_END] \\boxed{1} [HINT_START]\nUse metric units.\n[HINT_END]"
    assert parse_hint_vote(text).hint == "Use metric units."
    assert parse_hint_vote("[HINT_START]never closed \\boxed{1}") == HintVote(1, "")


def test_select_hint_takes_the_longest_positive_over_ten_chars() -> None:
    votes = [
        HintVote(1, "Short one."),  # exactly 10 chars: not more than 10
        HintVote(-1, "A much longer hint from a negative vote."),
        HintVote(1, "Say it in one line."),
        HintVote(None, "An unparsable vote's hint is ignored too, however long."),
        HintVote(1, "Give the answer first."),
    ]
    assert select_hint(votes) == "Give the answer first."
    assert select_hint(votes[:2]) == ""
    assert select_hint([]) == ""
    assert select_hint([HintVote(1, "abcdefghijk"), HintVote(1, "kjihgfedcba")]) == "abcdefghijk"
    assert select_hint([HintVote(1, "Short one.")], min_chars=5) == "Short one."


def test_inject_hint_appends_to_the_last_user_message() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Now 3+3?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
        {"role": "tool", "content": "6", "tool_call_id": "c"},
    ]
    hinted = inject_hint(messages, "Check your arithmetic.")
    assert hinted[3]["content"] == (
        "Now 3+3?\n\n[user's hint / instruction]\nCheck your arithmetic."
    )
    assert hinted[1] == messages[1] and hinted[5] == messages[5]
    assert messages[3]["content"] == "Now 3+3?"  # the input is not modified
    assert len(hinted) == len(messages)


def test_inject_hint_with_text_parts_and_without_a_user_message() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    hinted = inject_hint(parts, "Greet back.")
    assert hinted[0]["content"] == [
        {"type": "text", "text": "Hi"},
        {"type": "text", "text": "\n\n[user's hint / instruction]\nGreet back."},
    ]
    assert parts[0]["content"] == [{"type": "text", "text": "Hi"}]
    only_system = [{"role": "system", "content": "S"}]
    assert inject_hint(only_system, "H")[-1] == {
        "role": "user",
        "content": "[user's hint / instruction]\nH",
    }
