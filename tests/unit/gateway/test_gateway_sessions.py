"""Canonical history hashing: what makes two histories "the same conversation"."""

from clawrl.gateway.sessions import (
    assistant_prefixes,
    canonical_message,
    extend_hash,
    history_hashes,
)


def call(name, arguments, id_="call_1"):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_call_ids_and_argument_formatting_are_ignored():
    a = {"role": "assistant", "content": None, "tool_calls": [call("f", '{"b": 1, "a": [1, 2]}')]}
    b = {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("f", '{"a":[1,2],"b":1}', id_="call_other")],
    }
    assert canonical_message(a) == canonical_message(b)


def test_different_arguments_or_names_differ():
    a = {"role": "assistant", "content": None, "tool_calls": [call("f", '{"a": 1}')]}
    assert canonical_message(a) != canonical_message(
        {"role": "assistant", "content": None, "tool_calls": [call("f", '{"a": 2}')]}
    )
    assert canonical_message(a) != canonical_message(
        {"role": "assistant", "content": None, "tool_calls": [call("g", '{"a": 1}')]}
    )


def test_outer_whitespace_of_content_is_ignored_but_text_is_not():
    assert canonical_message({"role": "user", "content": " hi\n"}) == canonical_message(
        {"role": "user", "content": "hi"}
    )
    assert canonical_message({"role": "user", "content": "hi"}) != canonical_message(
        {"role": "user", "content": "hi!"}
    )
    assert canonical_message({"role": "user", "content": "hi"}) != canonical_message(
        {"role": "system", "content": "hi"}
    )


def test_chain_hash_identifies_prefixes():
    history = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    hashes = history_hashes(history)
    assert len(set(hashes)) == 4
    # The recorded turn: messages[:2] answered by a1 -> same hash as the prefix ending at a1.
    assert extend_hash(hashes[1], {"role": "assistant", "content": "a1"}) == hashes[2]
    assert history_hashes(history[:3]) == hashes[:3]
    # Prefix order matters.
    assert history_hashes([history[1], history[0]])[-1] != history_hashes(history[:2])[-1]


def test_assistant_prefixes_longest_first_and_not_the_last_message():
    history = [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "prefill"},
    ]
    hashes = history_hashes(history)
    assert assistant_prefixes(history, hashes) == [hashes[3], hashes[1]]
    assert assistant_prefixes(history[:1], hashes[:1]) == []
