"""The gateway over real SGLang: a turn it records (whole or streamed, through the official openai
client) holds exactly the prompt ids, response ids and log-probs SGLang's own chat endpoint
returns for the same request, the weight_version SGLang reported, and — with
SGLANG_RETURN_ORIGINAL_LOGPROB as the launcher sets it — log-probs of the raw distribution
when sampled at a temperature."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest
from transformers import AutoTokenizer

from clawrl.judge.teacher import teacher_from_meta, teacher_request
from tests.integration.gateway.conftest import GatewayFactory
from tests.integration.gateway.helpers import GatewayHandle, user
from tests.sglang.conftest import MODEL, relative_gap

pytestmark = [pytest.mark.sglang, pytest.mark.integration]

MAX_TOKENS = 12
VERSION = "4"  # loaded at the start of the module: a version the gateway can record as an int


@pytest.fixture(scope="module")
def gateway(sglang_url, model_dir, log_dir, redis_url) -> Iterator[GatewayHandle]:
    reply = httpx.post(
        f"{sglang_url}/update_weights_from_disk",
        json={"model_path": str(model_dir), "weight_version": VERSION},
        timeout=300,
    ).json()
    assert reply["success"], reply
    factory = GatewayFactory(log_dir, redis_url, sglang_url)
    handle = factory.start(f"sglang-{uuid.uuid4().hex[:6]}", CLAWRL_MODEL__PATH=MODEL)
    try:
        yield factory.ready(handle)
    finally:
        factory.stop_all()


def sglang_chat(url: str, messages: list[dict]) -> dict:
    """SGLang's own /v1/chat/completions for the request, with its token ids."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def one_turn(gateway: GatewayHandle, messages: list[dict], **options):
    """One request through the gateway (closing its session) -> (content, the recorded turn)."""
    session = f"sglang-{uuid.uuid4().hex[:8]}"
    client = gateway.openai(default_headers={"X-Session-Id": session, "X-Session-Done": "1"})
    if options.get("stream"):
        chunks = client.chat.completions.create(model="m", messages=messages, **options)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = client.chat.completions.create(model="m", messages=messages, **options)
        content = reply.choices[0].message.content
    [turn] = gateway.wait_turns(session, 1, timeout_s=60)
    return content, turn


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_recorded_turn_is_what_sglang_returns(gateway, sglang_url, stream):
    # With a system message: SmolLM2's own template (SGLang's) and the gateway's (clawrl's
    # ChatML + tools template, the model's has no tools) render the same ids; see below.
    messages = [{"role": "system", "content": "Be brief."},
                user("Name three colours of the rainbow.")]  # fmt: skip
    content, turn = one_turn(gateway, messages, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
    own = sglang_chat(sglang_url, messages)
    assert list(turn.prompt_ids) == own["prompt_token_ids"]  # the same chat template
    assert list(turn.response_ids) == own["response_token_ids"]
    expected = [entry["logprob"] for entry in own["logprobs"]["content"]]
    assert list(turn.response_logprobs) == pytest.approx(expected, abs=1e-4)
    assert turn.response_text == content == own["message"]["content"]
    assert json.loads(turn.messages_json) == messages
    assert (turn.weight_version, turn.policy_version) == (VERSION, int(VERSION))
    assert turn.finish_reason == own["finish_reason"] == "length"


def test_sampled_turns_record_raw_log_probs(gateway, sglang_url):
    """At temperature 2 the recorded log-probs are those of the untempered model (the teacher
    pass over the same ids), as the trainer assumes: SGLANG_RETURN_ORIGINAL_LOGPROB, which
    the launcher sets, at work through the gateway. SGLang decodes and prefills in bf16 on
    CPU, so a token's log-prob differs by up to ~1% or ~0.15 nats (CI saw -2.036 against
    -1.892); tempered ones (log softmax of logits / 2) are 17-26% off over a
    16-token reply (measured with transformers, 3 seeds)."""
    _, turn = one_turn(gateway, [user("Tell me a story.")], max_tokens=16, temperature=2.0)
    prompt, response = list(turn.prompt_ids), list(turn.response_ids)
    scored = httpx.post(
        f"{sglang_url}/generate", json=teacher_request(prompt, response, 0), timeout=300
    ).json()
    teacher = teacher_from_meta(scored["meta_info"], response, 0).logprobs
    # Single tokens 3.5-5 % apart were seen (bf16 decode vs prefill, test_generate_contract);
    # over the whole reply the gap is ~0.5-1 % of the log-probs' size, tempered ones 17-26 %.
    assert list(turn.response_logprobs) == pytest.approx(teacher, rel=0.08, abs=0.25)
    assert relative_gap(list(turn.response_logprobs), teacher) < 0.04
    assert turn.temperature == 2.0


def test_without_a_system_message_sglang_adds_smollm2s_default_one(gateway, sglang_url, model_dir):
    """A known difference: SGLang's chat endpoint renders SmolLM2's own template, which adds a
    default system message; the gateway (and the CPU engine's chat endpoint) render clawrl's
    ChatML + tools template, which does not. Through the gateway the engine is sent the
    gateway's ids, so what is served is what is recorded either way."""
    messages = [user("Name three colours of the rainbow.")]
    _, turn = one_turn(gateway, messages, max_tokens=1, temperature=0)
    own = sglang_chat(sglang_url, messages)["prompt_token_ids"]
    ours = list(turn.prompt_ids)  # <|im_start|>user ...
    extra = own[1 : len(own) - len(ours) + 1]
    assert own == ours[:1] + extra + ours[1:]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.decode(extra) == (
        "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>"
    )
