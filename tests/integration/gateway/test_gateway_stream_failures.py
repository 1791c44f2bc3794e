"""A stream the engine fails on its first event (issue 30), read by the official clients: it is
still a well-formed stream of its API, its opening events first, then the failure. Before, the
failure came alone: the `openai` client's stream helper refused it ("Expected to have received
`response.created` before `response.failed`") instead of reporting the failure, and its
`response.failed` carried a code outside the SDK's set (`engine_error`; now `server_error`, the
gateway's code leading the message). The `anthropic` client raised the `error` event either
way; it now sees `message_start` first, as from Anthropic's API. The engine is an SGLang
stand-in (real HTTP, in a thread) whose first event aborts the request, as SGLang's does when
it drops one."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.sdk_events import validate_event

from .test_gateway_apis import ScriptedEngine

pytestmark = pytest.mark.integration

ABORT = {"type": "abort", "message": "the scheduler dropped the request"}


class AbortingEngine(ScriptedEngine):
    """Every generation aborts on its first event."""

    def events(self, text: str, prompt_tokens: int) -> list[dict]:
        meta = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "finish_reason": ABORT,
                "output_token_logprobs": [], "weight_version": "0"}  # fmt: skip
        return [{"text": "", "output_ids": [], "meta_info": meta}]


@pytest.fixture(scope="module")
def failing(gateways):
    engine = AbortingEngine().start()
    handle = gateways.ready(gateways.start("stream-fails", engine_url=engine.url))
    yield handle, engine
    engine.stop()


def test_responses_stream_opens_before_it_fails(failing, session_id):
    handle, engine = failing
    engine.script("unused")
    client = handle.openai()
    with client.responses.stream(model="m", input="hi",
                                 extra_headers={"X-Session-Id": session_id}) as stream:  # fmt: skip
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds == ["response.created", "response.in_progress", "response.failed"]
    for event in events:
        validate_event(event.to_dict())
    failed = events[-1].response
    # The SDK's closed set of codes: the gateway's own code leads the message.
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.error.message.startswith("engine_error: ")
    assert failed.id == events[0].response.id
    engine.script("unused")
    raw = client.responses.create(model="m", input="hi", stream=True)
    assert [event.type for event in raw][:2] == ["response.created", "response.in_progress"]


def test_messages_stream_opens_before_it_fails(failing, session_id):
    handle, engine = failing
    engine.script("unused")
    client = anthropic.Anthropic(base_url=handle.url, api_key="none", max_retries=0)
    seen = []
    with pytest.raises(anthropic.APIStatusError) as info:
        with client.messages.stream(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Session-Id": session_id},
        ) as stream:
            for event in stream:
                validate_event(event.to_dict())
                seen.append(event.type)
    assert seen == ["message_start"]
    assert info.value.body["error"]["type"] == "api_error"
    assert "abort" in info.value.body["error"]["message"]


def test_chat_stream_opens_before_it_fails(failing, session_id):
    handle, engine = failing
    engine.script("unused")
    chunks = []
    with pytest.raises(openai.APIError) as info:
        for chunk in handle.openai().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            chunks.append(chunk)
    assert [c.choices[0].delta.role for c in chunks] == ["assistant"]
    assert info.value.body["code"] == "engine_error"
