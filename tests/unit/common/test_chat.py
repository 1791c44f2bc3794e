"""Chat rendering with SmolLM2's real tokenizer: ids match the text, tools and tool results are
rendered, and bad content is a clear error."""

import pytest

from clawrl.common.chat import ChatRenderer, ChatTemplateError
from clawrl.common.models import SMOLLM2_TINY
from clawrl.common.settings import ModelSettings

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_settings(ModelSettings(path=SMOLLM2_TINY))


def test_plain_chat_is_chatml_with_a_generation_prompt(renderer: ChatRenderer) -> None:
    text = renderer.render_text([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = renderer.render_ids([{"role": "user", "content": "hi"}])
    assert renderer.tokenizer.decode(ids) == text
    im_start = renderer.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start  # special tokens are single ids, not spelled out
    assert renderer.eos_token_ids == [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_tools_and_tool_results_are_rendered(renderer: ChatRenderer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    text = renderer.render_text(messages, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_text_parts_are_joined(renderer: ChatRenderer) -> None:
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    assert "hello there" in renderer.render_text([{"role": "user", "content": parts}])


def test_image_parts_are_rejected(renderer: ChatRenderer) -> None:
    content = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(ChatTemplateError, match="image_url"):
        renderer.render_ids([{"role": "user", "content": content}])
