"""A stop string that spans tokens, against engines that trim it as SGLang does (issue 30): what
a client streams, what the turn records (the text the judge reads and the assistant message)
and the same tokens unstreamed are one text, cut where the stop string begins. The CPU engine
holds such text back itself (tests/integration/gateway/test_gateway_stop_strings.py); SGLang
0.5 keeps the part it already streamed, and earlier SGLang took it back from its cumulative
text at the end, after streaming it."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from aiohttp import web

from clawrl.common.sglang_client import SGLangClient
from clawrl.gateway.control import PauseGate
from clawrl.gateway.generation import Generation, HeldText, trim_stop_string
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.protocol import parse_chat_request
from clawrl.gateway.serving import ChatService
from tests.scripted_engine import scripted_engine, sse

TOKENS = ["Hello", " Virgin", "activ", "ists"]  # stop "inac" begins in " Virgin"
STOP = "inac"
EXPECTED = "Hello Virg"


class Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(TOKENS[i] for i in ids)


class Renderer:
    eos_token_ids = [99]
    tokenizer = Tokenizer()

    def render_ids(self, messages, tools=None):
        return [50, 51, 52]


def event(n: int, text: str, finish: dict | None = None) -> dict:
    """A cumulative event after `n` tokens, with the text the engine sends."""
    return {
        "text": text,
        "output_ids": list(range(n)),
        "meta_info": {
            "prompt_tokens": 3,
            "completion_tokens": n,
            "finish_reason": finish,
            "output_token_logprobs": [[-0.1, i, None] for i in range(n)],
        },
    }


MATCHED = {"type": "stop", "matched": STOP}
# SGLang 0.5.23: the stream carries " Virgin" whole (no stop string yet), then the match at
# "activ" trims only what was not sent: the leftover "in" stays. Unstreamed, the whole text is
# trimmed at once.
SGLANG_05 = [event(1, "Hello"), event(2, "Hello Virgin"), event(3, "Hello Virgin", MATCHED)]
# Earlier SGLang: the last cumulative event is the trimmed text, shorter than what was sent.
SGLANG_04 = [event(1, "Hello"), event(2, "Hello Virgin"), event(3, EXPECTED, MATCHED)]
WHOLE = {"SGLANG_05": event(3, EXPECTED, MATCHED), "FORCE_INTERVAL": SGLANG_05[-1]}


@contextlib.asynccontextmanager
async def service_for(events: list[dict], whole: dict):
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["sampling_params"]["stop"] == [STOP]
        return await sse(request, events) if body["stream"] else web.json_response(whole)

    async with scripted_engine({"/generate": generate}) as url:
        engine = SGLangClient(url)
        metrics = GatewayMetrics()
        yield ChatService(renderer=Renderer(), engine=engine, metrics=metrics,
                          gate=PauseGate(metrics, hold_timeout_s=1, retry_after_s=1),
                          recorder=None, model_name="m", context_length=8192)  # fmt: skip
        await engine.aclose()


def request(stream: bool):
    body = {"messages": [{"role": "user", "content": "hi"}], "stop": [STOP], "stream": stream}
    return parse_chat_request(json.dumps(body).encode(), {})


async def streamed(service: ChatService) -> tuple[str, str, str]:
    """(the streamed text, the recorded text, the recorded message's content)."""
    done = []

    async def on_complete(completion) -> None:
        done.append(completion)

    stream = await service.open_stream(request(True), time.perf_counter(), None, on_complete)
    lines = [line async for line in stream.lines]
    await stream.release()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return text, done[0].generation.text, done[0].message["content"]


@pytest.mark.parametrize("engine", ["SGLANG_05", "SGLANG_04"])
async def test_streamed_recorded_and_whole_text_are_cut_at_the_stop_string(engine):
    events = SGLANG_05 if engine == "SGLANG_05" else SGLANG_04
    async with service_for(events, WHOLE["SGLANG_05"]) as service:
        assert await streamed(service) == (EXPECTED, EXPECTED, EXPECTED)
        whole = await service.generate(request(False))
        assert whole.generation.text == whole.message["content"] == EXPECTED


async def test_a_whole_reply_with_the_leftover_is_cut_too():
    """SGLang's unstreamed reply keeps the leftover when its force-stream interval fell on it."""
    async with service_for(SGLANG_05, WHOLE["FORCE_INTERVAL"]) as service:
        whole = await service.generate(request(False))
        assert whole.generation.text == whole.message["content"] == EXPECTED


def test_only_a_leftover_of_the_stop_string_is_cut():
    def finished(text: str, ids: list[int]) -> Generation:
        g = Generation(text=text, ids=ids, finish="stop", matched_stop=STOP)
        trim_stop_string(g, Tokenizer().decode)
        return g.text

    assert finished("Hello Virgin", [0, 1, 2]) == EXPECTED
    assert finished(EXPECTED, [0, 1, 2]) == EXPECTED  # the CPU engine's: already cut
    # Text that is no leftover of the stop string (an engine's own text) stays as it is.
    assert finished("Hello Virgin!", [0, 1, 2]) == "Hello Virgin!"
    assert finished("Hello Vi", [0, 1, 2]) == "Hello Vi"
    g = Generation(text="Hello Virgin", ids=[0, 1, 2], finish="stop", matched_stop=STOP)
    trim_stop_string(g, None)  # no tokenizer: nothing to tell a leftover by
    assert g.text == "Hello Virgin"


def test_held_text_keeps_back_what_may_begin_a_stop_string():
    held = HeldText.for_stops(["inac", "x"])
    assert held.hold == 3
    assert held.advance("Hello") == "He"
    assert held.advance("Hello Virgin") == "llo Vir"
    assert held.advance(EXPECTED, finished=True) == "g"
    plain = HeldText.for_stops([])
    assert plain.advance("Hel") == "Hel" and plain.advance("Hello") == "lo"
