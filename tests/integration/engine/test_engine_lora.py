"""LoRA adapters served by a real CPU engine process with SGLang's surface: load and unload
with SGLang's bodies and errors, lora_path on /generate and the OpenAI route, a mixed batch
equal to each request alone, a prefix cache kept per adapter, unload waiting for the requests
that use the adapter (and SGLang's implicit reload of an unloaded adapter a request names), a
full-weight update with adapters loaded, and the served log-probs equal to transformers +
peft."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.common.sglang_client import EngineRequestError, SGLangClient
from tests.conftest import wait_until

from .helpers import TIMEOUT, greedy, metric
from .lora_adapters import make_adapter

pytestmark = pytest.mark.integration

MODEL = "smollm2-tiny"
PROMPT_IDS = [1, 504, 3458, 282, 4649, 314, 1456, 28]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(ModelSettings(path=MODEL))


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a1": make_adapter(model_dir, root / "a1", seed=1, scale=0.5),
        "a2": make_adapter(model_dir, root / "a2", seed=2, scale=0.5),
        "a3": make_adapter(model_dir, root / "a3", seed=3, scale=0.5),
        "r32": make_adapter(model_dir, root / "r32", rank=32, alpha=32, seed=4),
    }


@pytest.fixture(scope="module")
def url(engine_factory, adapters) -> str:
    # Its own engine: adapters come and go, and a test swaps its base weights.
    return engine_factory(
        MODEL, "--lora-paths", f"a1={adapters['a1']}", "--max-lora-rank", "16",
        "--lora-target-modules", "all", "--weight-version", "0",
    )  # fmt: skip


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)


def load(url: str, name: str, path: Path | str) -> httpx.Response:
    return post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload(url: str, name: str) -> httpx.Response:
    return post(url, "/unload_lora_adapter", {"lora_name": name})


def answer(
    url: str, lora: str | None = None, max_new_tokens: int = 10, input_ids=PROMPT_IDS, **body
) -> dict:
    """A greedy /generate (with output log-probs) under adapter `lora` (None: base)."""
    return greedy(url, max_new_tokens=max_new_tokens, **request(input_ids, lora), **body)


def request(input_ids: list[int], lora: str | None) -> dict:
    body = {"input_ids": input_ids, "return_logprob": True, "sampling_params": {"ignore_eos": True}}
    return {**body, "lora_path": lora} if lora else body


def logprobs(reply: dict) -> list[float]:
    return [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]


def test_load_and_unload_answer_with_sglangs_bodies(url, adapters, model_dir):
    reply = load(url, "a2", adapters["a2"])
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"a1": str(adapters["a1"]), "a2": str(adapters["a2"])},
    }
    refusals = {
        "already loaded": load(url, "a2", adapters["a2"]),
        "Can't find an adapter directory": load(url, "x", "/nonexistent/adapter"),
        "adapter_config.json": load(url, "x", model_dir),  # a model, not an adapter
        "with rank 32 is incompatible": load(url, "x", adapters["r32"]),
        "LoRA with name nope does not exist": unload(url, "nope"),
    }
    for message, reply in refusals.items():
        assert reply.status_code == 400, (message, reply.text)
        body = reply.json()
        assert body["success"] is False and message in body["error_message"]
        assert set(body["loaded_adapters"]) == {"a1", "a2"}

    models = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"]
    base = models[0]["id"]
    assert [(m["id"], m["root"], m["parent"]) for m in models[1:]] == [
        ("a1", str(adapters["a1"]), base),
        ("a2", str(adapters["a2"]), base),
    ]

    served = answer(url, "a2")
    reply = unload(url, "a2")
    assert reply.status_code == 200 and reply.json()["loaded_adapters"] == {
        "a1": str(adapters["a1"])
    }
    assert metric(url, "clawrl_engine_lora_adapters") == 1
    # As SGLang does, a request naming an adapter unloaded before loads it again from its path
    # (with a new id: nothing cached); a name never loaded is refused.
    again = answer(url, "a2")
    assert again["output_ids"] == served["output_ids"] and again["meta_info"]["cached_tokens"] == 0
    assert set(unload(url, "a2").json()["loaded_adapters"]) == {"a1"}
    never = post(url, "/generate", {"input_ids": PROMPT_IDS, "lora_path": "nope"})
    assert never.status_code == 400
    assert "Got LoRA adapter that has never been loaded: nope" in never.text
    assert metric(url, "clawrl_engine_rejected_requests_total", reason="adapter_not_loaded") >= 1
    assert metric(url, "clawrl_engine_lora_updates_total", op="load", result="failure") >= 4


def test_the_client_loads_lists_and_unloads(url, adapters):
    async def calls():
        client = SGLangClient(url)
        try:
            loaded = await client.load_lora_adapter("a3", str(adapters["a3"]))
            listed = await client.lora_adapters()
            with pytest.raises(EngineRequestError, match="already loaded") as refused:
                await client.load_lora_adapter("a3", str(adapters["a3"]))
            unloaded = await client.unload_lora_adapter("a3")
            return loaded, listed, refused.value, unloaded, await client.lora_adapters()
        finally:
            await client.aclose()

    loaded, listed, refused, unloaded, after = asyncio.run(calls())
    assert (
        listed
        == loaded["loaded_adapters"]
        == {
            "a1": str(adapters["a1"]),
            "a3": str(adapters["a3"]),
        }
    )
    assert refused.status_code == 400
    assert unloaded["loaded_adapters"] == after == {"a1": str(adapters["a1"])}


def test_lora_path_on_generate_and_on_the_openai_route(url):
    base, tuned = answer(url), answer(url, "a1")
    assert tuned["output_ids"] != base["output_ids"]
    assert answer(url, lora=None, lora_path=["a1"])["output_ids"] == tuned["output_ids"]
    assert base["meta_info"]["weight_version"] == tuned["meta_info"]["weight_version"]

    served = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
    plain = post(url, "/v1/chat/completions", chat).json()
    by_field = post(url, "/v1/chat/completions", {**chat, "lora_path": "a1"}).json()
    by_model = post(url, "/v1/chat/completions", {**chat, "model": f"{served}:a1"}).json()
    text = [r["choices"][0]["message"]["content"] for r in (plain, by_field, by_model)]
    assert text[1] == text[2] != text[0]
    for body in ({**chat, "lora_path": "nope"}, {**chat, "model": f"{served}:nope"}):
        refused = post(url, "/v1/chat/completions", body)
        assert refused.status_code == 400 and "never been loaded: nope" in refused.text


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(url, adapters):
    assert load(url, "a2", adapters["a2"]).status_code == 200
    try:
        names = [None, "a1", "a2", "a1", None, "a2"]
        alone = {name: answer(url, name, max_new_tokens=16) for name in names[:3]}
        before = batched_steps(url)

        async def together():
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:
                params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
                replies = [
                    client.post(
                        f"{url}/generate",
                        json={**request(PROMPT_IDS, name), "sampling_params": params},
                    )
                    for name in names
                ]
                return [r.json() for r in await asyncio.gather(*replies)]

        mixed = asyncio.run(together())
        assert batched_steps(url) - before >= 10  # they did share decode steps
        for name, reply in zip(names, mixed, strict=True):
            single = alone[name]
            assert reply["output_ids"] == single["output_ids"]
            assert logprobs(reply) == pytest.approx(logprobs(single), abs=1e-5)
        assert len({tuple(r["output_ids"]) for r in mixed}) == 3
    finally:
        unload(url, "a2")


def batched_steps(url: str) -> float:
    total = metric(url, "clawrl_engine_decode_batch_size_count")
    return total - metric(url, "clawrl_engine_decode_batch_size_bucket", le="1.0")


def test_the_prefix_cache_never_shares_kv_across_adapters(url, adapters):
    prompt = list(range(700, 760))  # shares no prefix with any other test's prompt

    def cached(name: str | None) -> int:
        return answer(url, name, input_ids=prompt)["meta_info"]["cached_tokens"]

    assert cached("a1") == 0
    assert cached("a1") > 50  # the same adapter reuses its own KV
    assert cached(None) == 0  # the base model does not get a1's
    assert load(url, "a3", adapters["a3"]).status_code == 200
    assert cached("a3") == 0
    held = metric(url, "clawrl_engine_prefix_cache_tokens")
    assert unload(url, "a3").status_code == 200
    # a3's KV (its prompt and output) went with it.
    assert held - metric(url, "clawrl_engine_prefix_cache_tokens") >= len(prompt)
    assert load(url, "a3", adapters["a3"]).status_code == 200
    assert cached("a3") == 0  # loaded again: a new adapter, nothing cached for it
    unload(url, "a3")


def served(url: str) -> list[str]:
    """The model ids /v1/models lists (the base, then the registered adapters)."""
    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"]]


def test_unload_waits_for_the_running_request_and_a_new_one_reloads_after_it(url, adapters):
    assert load(url, "a3", adapters["a3"]).status_code == 200
    events: list = []
    first_event = threading.Event()
    stream_done: list[float] = []

    def run_stream() -> None:
        body = {
            "input_ids": PROMPT_IDS,
            "lora_path": "a3",
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
        }
        with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True},
                          timeout=TIMEOUT) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    first_event.set()
        stream_done.append(time.monotonic())

    streamer = threading.Thread(target=run_stream)
    streamer.start()
    assert first_event.wait(60)
    unloaded: list = []
    unloader = threading.Thread(
        target=lambda: unloaded.append((unload(url, "a3"), time.monotonic()))
    )
    unloader.start()
    # Until the engine took the unload (a3 leaves the registry at once, then the unload waits):
    # on a loaded host the late request could otherwise arrive first and use a3 as loaded.
    wait_until(lambda: "a3" not in served(url), 30, "the unload reaching the engine")
    # A request naming a3 meanwhile waits for the unload, then loads a3 again (SGLang's order).
    late = post(url, "/generate", {"input_ids": PROMPT_IDS, "lora_path": "a3"})
    late_at = time.monotonic()
    streamer.join(120)
    unloader.join(60)
    reply, unloaded_at = unloaded[0]
    assert reply.status_code == 200 and "a3" not in reply.json()["loaded_adapters"]
    assert unloaded_at >= stream_done[0]  # the unload waited for the running stream
    assert late.status_code == 200 and late_at >= unloaded_at
    assert events[-1] == "data: [DONE]"
    last = [e for e in events if e != "data: [DONE]"][-1]
    assert '"finish_reason": {"type": "length", "length": 400}' in last
    assert unload(url, "a3").status_code == 200  # the late request's reload


def test_a_full_weight_update_keeps_the_adapters(url, adapters, model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    changed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in tensors.items()}
    (tmp_path / "v1").mkdir()
    save_file(changed, str(tmp_path / "v1" / "model.safetensors"))
    base_before, tuned_before = answer(url), answer(url, "a1")
    reply = post(url, "/update_weights_from_disk",
                 {"model_path": str(tmp_path / "v1"), "weight_version": "1"})  # fmt: skip
    assert reply.status_code == 200, reply.text
    try:
        listed = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"]
        assert [m["id"] for m in listed[1:]] == ["a1"]
        base_after, tuned_after = answer(url), answer(url, "a1")
        assert tuned_after["meta_info"]["weight_version"] == "1"
        assert base_after["output_ids"] != base_before["output_ids"]
        # The adapter now sits on the new base, exactly as peft puts it there.
        expected = reference_logprobs(
            tmp_path / "v1", model_dir, adapters["a1"], PROMPT_IDS, tuned_after["output_ids"]
        )
        assert logprobs(tuned_after) == pytest.approx(expected, abs=1e-4)
        assert tuned_after["output_ids"] != tuned_before["output_ids"]
    finally:
        restore = {"model_path": str(model_dir), "weight_version": "0"}
        assert post(url, "/update_weights_from_disk", restore).status_code == 200


def reference_logprobs(
    weights_dir: Path,
    config_dir: Path,
    adapter: Path | None,
    prompt: list[int],
    output: list[int],
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """Log-probs of `output` after `prompt`, teacher-forced through transformers (+ peft) in
    `dtype` (log-softmax in float32): an implementation independent of the engine's batching,
    caches and decode loop."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(load_file(str(weights_dir / "model.safetensors")), strict=False)
    model.tie_weights()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.to(dtype).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp[torch.arange(len(output)), torch.tensor(output)].tolist()


# The fidelity tolerances docs/engine.md states (SmolLM2-135M-Instruct, a rank-16 adapter, 24
# greedy tokens): the largest and the mean |served - transformers + peft| log-prob, against a
# float32 recomputation (what the trainer computes) and against one in the engine's own dtype.
# Measured (3 runs): float32 7.4e-6 max; bfloat16 0.11-0.15 / 0.040-0.041 against float32,
# 0.13-0.15 / 0.044-0.047 against bfloat16 (bf16's rounding differs between any two
# implementations, so its own dtype is no closer).
FIDELITY_TOLERANCE = {
    "float32": {"float32": (1e-4, 1e-4)},
    "bfloat16": {"float32": (0.3, 0.08), "bfloat16": (0.3, 0.08)},
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_logprobs_under_an_adapter_equal_transformers_and_peft(
    engine_factory, tmp_path, dtype
):
    """SmolLM2-135M-Instruct with a rank-16 adapter on all seven projections: the log-probs the
    engine reports in each dtype equal a transformers + peft recomputation within that dtype's
    stated tolerance (float32: 1e-4; bfloat16: 0.3 at most, 0.08 on average), and are far from
    the base model's."""
    model_dir = resolve_model_dir(ModelSettings(path="SmolLM2-135M-Instruct"))
    adapter = make_adapter(model_dir, tmp_path / "fid", rank=16, alpha=32, seed=5, scale=0.02)
    url = engine_factory("SmolLM2-135M-Instruct", "--lora-paths", f"fid={adapter}",
                         "--dtype", dtype)  # fmt: skip
    ids = [1, 504, 3458, 282, 4649, 314, 1456, 28]
    tuned = answer(url, "fid", max_new_tokens=24, input_ids=ids)
    base = answer(url, None, max_new_tokens=24, input_ids=ids)
    assert tuned["output_ids"] != base["output_ids"]  # the adapter changes what is said
    served = logprobs(tuned)
    for reference, (most, mean) in FIDELITY_TOLERANCE[dtype].items():
        expected = reference_logprobs(
            model_dir, model_dir, adapter, ids, tuned["output_ids"], getattr(torch, reference)
        )
        errors = [abs(a - b) for a, b in zip(served, expected, strict=True)]
        print(f"{dtype} served vs {reference} transformers+peft: max {max(errors):.2e}, "
              f"mean {sum(errors) / len(errors):.2e}")  # fmt: skip
        assert max(errors) < most and sum(errors) / len(errors) < mean, (reference, errors)
    without = reference_logprobs(model_dir, model_dir, None, ids, tuned["output_ids"])
    gap = max(abs(a - b) for a, b in zip(served, without, strict=True))
    print(f"{dtype} served vs the base model: {gap:.3f}")
    assert gap > 0.1


def test_an_adapter_served_beyond_the_trained_context_keeps_the_stretched_rope(
    engine_factory, tmp_path
):
    """Served at 16384 tokens (twice smollm2-tiny's 8192: RoPE stretched with yarn, as the stack
    runs it), an adapter's log-probs are those of transformers + peft on the same stretched
    config, the model the trainer trains; an unstretched recomputation is not the reference (it
    made the LoRA learning test see isolated positions off by up to 0.75)."""
    from transformers import AutoConfig

    from clawrl.common.models import stretch_config

    model_dir = resolve_model_dir(ModelSettings(path="smollm2-tiny"))
    adapter = make_adapter(model_dir, tmp_path / "long", rank=8, alpha=16, seed=7, scale=0.5)
    url = engine_factory("smollm2-tiny", "--context-length", "16384",
                         "--lora-paths", f"long={adapter}")  # fmt: skip
    ids = [1, 4093, 198, 31530, 549, 1488, 30, 2, 198, 1, 520, 9531, 198]
    tuned = answer(url, "long", max_new_tokens=32, input_ids=ids)
    stretched = tmp_path / "stretched"
    config = AutoConfig.from_pretrained(str(model_dir))
    assert stretch_config(config, 16384, "yarn")
    config.save_pretrained(str(stretched))
    served = logprobs(tuned)
    expected = reference_logprobs(model_dir, stretched, adapter, ids, tuned["output_ids"])
    plain = reference_logprobs(model_dir, model_dir, adapter, ids, tuned["output_ids"])
    error = max(abs(a - b) for a, b in zip(served, expected, strict=True))
    gap = max(abs(a - b) for a, b in zip(served, plain, strict=True))
    print(f"served vs stretched transformers+peft: {error:.2e}; vs unstretched: {gap:.2e}")
    assert error < 1e-4
    assert gap > 1e-2  # the stretch shows at 13 + 32 tokens already


def test_more_adapters_than_slots_over_http(engine_factory, adapters):
    """Two slots, three adapters loaded at most: concurrent requests over three adapters and the
    base model each get what they get alone while the engine evicts and injects between steps
    (counted in /metrics); loading a fourth unloads the least recently used adapter, which a
    later request loads again from its path; a name never loaded is SGLang's 400."""
    url = engine_factory(
        MODEL, "--lora-paths", *(f"{n}={adapters[n]}" for n in ("a1", "a2", "a3")),
        "--max-loras-per-batch", "2", "--max-loaded-loras", "3",
    )  # fmt: skip
    assert metric(url, "clawrl_engine_lora_adapters_resident") == 2
    names = [None, "a1", "a2", "a3"]
    alone = {name: answer(url, name, max_new_tokens=24) for name in names}

    async def together():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
            replies = [
                client.post(f"{url}/generate",
                            json={**request(PROMPT_IDS, name), "sampling_params": params})
                for name in names
            ]  # fmt: skip
            return [r.json() for r in await asyncio.gather(*replies)]

    for name, reply in zip(names, asyncio.run(together()), strict=True):
        assert reply["output_ids"] == alone[name]["output_ids"], name
        assert logprobs(reply) == pytest.approx(logprobs(alone[name]), abs=1e-5)
    assert metric(url, "clawrl_engine_lora_on_demand_loads_total") >= 1
    assert metric(url, "clawrl_engine_lora_evictions_total", level="resident") >= 1
    assert metric(url, "clawrl_engine_lora_slot_waits_total") >= 1
    assert metric(url, "clawrl_engine_lora_adapters_resident") == 2

    for name in ("a2", "a3", "a1"):  # a2 is now the least recently used
        answer(url, name, max_new_tokens=1)
    reply = load(url, "a4", adapters["a1"])  # a1's directory under another name
    assert reply.status_code == 200 and set(reply.json()["loaded_adapters"]) == {"a1", "a3", "a4"}
    assert metric(url, "clawrl_engine_lora_evictions_total", level="loaded") == 1
    assert answer(url, "a2", max_new_tokens=24)["output_ids"] == alone["a2"]["output_ids"]
    assert "a2" in httpx.get(f"{url}/v1/models", timeout=TIMEOUT).text
    never = post(url, "/generate", {"input_ids": PROMPT_IDS, "lora_path": "nope"})
    assert never.status_code == 400
    assert "Got LoRA adapter that has never been loaded: nope" in never.text


def test_an_adapter_put_in_the_merged_adapters_modules_is_served_with_its_own_weights(
    engine_factory, adapters, model_dir
):
    """Two slots: a1 answers alone long enough to run on merged weights; a3 then evicts it and
    takes over its injected modules (the same peft name, new tensors). a3's reply is a3's,
    as transformers + peft computes it, not a1's merged one; a1 loaded back is a1 again."""
    url = engine_factory(
        MODEL, "--lora-paths", *(f"{n}={adapters[n]}" for n in ("a1", "a2", "a3")),
        "--max-loras-per-batch", "2", "--lora-merge-after", "4",
    )  # fmt: skip
    first = answer(url, "a1", max_new_tokens=12)  # 12 passes under a1 alone: merged after 4
    answer(url, "a2", max_new_tokens=1)  # a1 is now the least recently used
    for name in ("a3", "a1"):  # each evicts the other into the modules it leaves
        reply = answer(url, name, max_new_tokens=12)
        expected = reference_logprobs(
            model_dir, model_dir, adapters[name], PROMPT_IDS, reply["output_ids"]
        )
        assert logprobs(reply) == pytest.approx(expected, abs=1e-4), name
    assert reply["output_ids"] == first["output_ids"]
    assert metric(url, "clawrl_engine_lora_evictions_total", level="resident") >= 2
