"""Tool-call parsing on real model-style strings, whole and streamed in awkward pieces."""

import json

import pytest

from clawrl.gateway.tool_calls import StreamingToolCallParser, parse_tool_calls

QWEN = (
    "I'll check the weather.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)
TWO_CALLS = (
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "b.txt"}}\n</tool_call>'
)


def test_single_call_with_leading_text():
    content, calls = parse_tool_calls(QWEN)
    assert content == "I'll check the weather."
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert calls[0].id.startswith("call_")


def test_two_calls_no_content():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content is None
    assert [json.loads(c.arguments)["path"] for c in calls] == ["a.txt", "b.txt"]


def test_unterminated_call_at_end_of_output_is_parsed():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "ls", "arguments": {}}')
    assert content is None and calls[0].name == "ls" and calls[0].arguments == "{}"


def test_arguments_given_as_a_json_string():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert json.loads(calls[0].arguments) == {"x": 1}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["get_weather"]</tool_call>',
        "plain answer, no tools",
    ],
)
def test_malformed_blocks_stay_in_content(text):
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text


def test_parser_none_returns_text():
    assert parse_tool_calls(QWEN, "none") == (QWEN, [])


def stream(text: str, sizes: list[int]):
    parser = StreamingToolCallParser()
    out, pos, i = [], 0, 0
    while pos < len(text):
        size = sizes[i % len(sizes)]
        out += parser.feed(text[pos : pos + size])
        pos += size
        i += 1
    out += parser.finish()
    content = "".join(d.content for d in out if d.content)
    calls = [d.tool_call for d in out if d.tool_call]
    return content, calls, out


@pytest.mark.parametrize("sizes", [[1], [2, 3], [5], [7, 1, 11], [1000]])
def test_streaming_matches_whole_parse(sizes):
    for text in (QWEN, TWO_CALLS, "no calls here < not a tag <tool", "a <tool_c b"):
        content, calls, _ = stream(text, sizes)
        whole_content, whole_calls = parse_tool_calls(text)
        assert [c.name for c in calls] == [c.name for c in whole_calls]
        assert [c.arguments for c in calls] == [c.arguments for c in whole_calls]
        assert content.strip() == (whole_content or "").strip()


def test_streaming_never_leaks_a_partial_tag():
    _, _, deltas = stream(QWEN, [1])
    assert not any("<" in (d.content or "") for d in deltas)


def test_streaming_broken_call_is_flushed_as_content():
    content, calls, _ = stream("x <tool_call>{oops", [3])
    assert calls == [] and content == "x <tool_call>{oops"
