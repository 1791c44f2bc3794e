"""Pure parts of recording: the whole next state, and which version a turn records."""

from clawrl.gateway.recording import next_state_messages, policy_version_of


def test_next_state_is_everything_after_the_last_reply():
    tools = [{"role": "tool", "tool_call_id": c, "content": c} for c in ("a", "b")]
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": []},
        *tools,
        {"role": "user", "content": "and?"},
    ]
    assert next_state_messages(messages) == [*tools, {"role": "user", "content": "and?"}]
    assert next_state_messages(messages[:3]) == tools[:1]


def test_without_a_reply_the_last_message_is_the_next_state():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert next_state_messages(messages) == [messages[-1]]
    ends_with_reply = [*messages, {"role": "assistant", "content": "prefill"}]
    assert next_state_messages(ends_with_reply) == [ends_with_reply[-1]]


def test_policy_version_is_the_engines_when_it_is_a_number():
    assert policy_version_of("12", 3) == 12
    assert policy_version_of("default", 3) == 3
    assert policy_version_of("", 3) == 3
