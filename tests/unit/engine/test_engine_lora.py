"""LoRA serving's SGLang surface without a server: flags, `--lora-paths` entries, target-module
rules, the registry's unload protocol, adapter checks, and prefix-cache separation."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.adapters import prepare_adapter
from clawrl.engine.cpu.prefix_cache import PrefixCache
from clawrl.engine.launcher import build_argv
from clawrl.engine.lora import (
    AdapterNotLoaded,
    LoraError,
    LoraRef,
    LoraRegistry,
    model_adapter,
    normalized_modules,
    parse_lora_path,
)
from clawrl.engine.main import load_settings, parse_args
from clawrl.engine.settings import EngineServerSettings, EngineSettings
from tests.integration.engine.lora_adapters import make_adapter


def test_lora_paths_entries_in_sglangs_three_forms():
    assert parse_lora_path("/ckpt/v3") == ("/ckpt/v3", "/ckpt/v3", False)
    assert parse_lora_path("policy-v3=/ckpt/v3") == ("policy-v3", "/ckpt/v3", False)
    entry = json.dumps({"lora_name": "p", "lora_path": "/ckpt/p", "pinned": True})
    assert parse_lora_path(entry) == ("p", "/ckpt/p", True)
    with pytest.raises(LoraError, match="lora_name and lora_path"):
        parse_lora_path('{"lora_name": "p"}')
    with pytest.raises(LoraError, match="NAME=PATH"):
        parse_lora_path("=/ckpt")


def test_target_modules_compare_as_sglang_groups_them():
    # k_proj fits a server configured for q_proj: both are qkv_proj to SGLang.
    assert normalized_modules(["k_proj"]) <= normalized_modules(["q_proj"])
    assert normalized_modules(["up_proj"]) == {"gate_up_proj"}
    assert not normalized_modules(["down_proj"]) <= normalized_modules(["q_proj", "o_proj"])
    assert normalized_modules(["all"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_model_field_names_an_adapter_after_its_first_colon():
    assert model_adapter("SmolLM2-135M-Instruct:policy-v3") == "policy-v3"
    assert model_adapter("org/base:a:b") == "a:b"
    assert model_adapter("SmolLM2-135M-Instruct") is None
    assert model_adapter("base:") is None
    assert model_adapter(None) is None


def test_lora_settings_follow_sglangs_rules():
    assert not EngineServerSettings().lora_enabled
    assert EngineServerSettings(lora_paths=["a=/x"]).lora_enabled  # implied by paths
    with pytest.raises(ValueError, match="both --max-lora-rank and --lora-target-modules"):
        EngineServerSettings(enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"'all' .* only module"):
        EngineServerSettings(lora_paths=["a=/x"], lora_target_modules=["all", "q_proj"])
    with pytest.raises(ValueError, match="not supported"):
        EngineServerSettings(lora_paths=["a=/x"], lora_target_modules=["lm_head"])


def test_lora_flags_reach_sglang_and_the_cpu_engine_alike(monkeypatch):
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent.toml")
    cli = ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
           "--lora-paths", "a=/ckpt/a", "/ckpt/b", "--max-loras-per-batch", "4"]  # fmt: skip
    for backend in ("cpu", "sglang"):
        settings = load_settings(parse_args(["--backend", backend, *cli]))
        engine = settings.engine
        assert engine.enable_lora and engine.max_lora_rank == 16
        assert engine.lora_target_modules == ["q_proj", "v_proj"]
        assert engine.lora_paths == ["a=/ckpt/a", "/ckpt/b"]
        assert engine.max_loras_per_batch == 4
    argv = build_argv(settings, model="/models/policy")
    assert "--enable-lora" in argv
    assert argv[argv.index("--max-loras-per-batch") + 1] == "4"
    assert argv[argv.index("--max-lora-rank") + 1] == "16"
    paths = argv.index("--lora-paths")
    assert argv[paths + 1 : paths + 3] == ["a=/ckpt/a", "/ckpt/b"]
    modules = argv.index("--lora-target-modules")
    assert argv[modules + 1 : modules + 3] == ["q_proj", "v_proj"]
    # LoRA off: not one LoRA flag.
    off = build_argv(EngineSettings(), model="/models/policy")
    assert not [a for a in off if "lora" in a]


async def test_unload_refuses_new_requests_at_once_and_waits_for_running_ones():
    registry = LoraRegistry()
    ref = LoraRef("v1", "/ckpt/v1")
    registry.register(ref)
    with pytest.raises(LoraError, match="already loaded"):
        registry.register(LoraRef("v1", "/ckpt/other"))
    held = registry.acquire("v1")
    assert held.key == ref.key and registry.users(ref) == 1
    assert registry.unregister("v1") == ref
    with pytest.raises(AdapterNotLoaded, match="not loaded: v1"):
        registry.acquire("v1")
    waiting = asyncio.create_task(registry.wait_unused(ref))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # a request still uses it
    registry.release(held)
    await asyncio.wait_for(waiting, 1)
    with pytest.raises(LoraError, match="does not exist"):
        registry.unregister("v1")
    # The same name loaded again is a new adapter (its own cache key).
    again = LoraRef("v1", "/ckpt/v1")
    registry.register(again)
    assert again.key != ref.key and registry.loaded() == {"v1": "/ckpt/v1"}


def test_prefix_cache_never_shares_kv_across_adapters():
    cache = PrefixCache(budget_tokens=100)
    ids = [1, 2, 3, 4]
    kv = [(torch.randn(2, 4, 8), torch.randn(2, 4, 8))]
    cache.insert(ids, kv, "a1")
    assert cache.match(ids, 4, "a1")[0] == 4
    assert cache.match(ids, 4, "a2") == (0, None)
    assert cache.match(ids, 4, None) == (0, None)
    cache.insert(ids, kv, None)
    assert cache.tokens == 8
    assert cache.drop("a1") == 4 and cache.tokens == 4
    assert cache.match(ids, 4, "a1") == (0, None)
    assert cache.match(ids, 4, None)[0] == 4


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(ModelSettings(path="smollm2-tiny"))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model_dir, model


def prepare(tiny, path, max_rank=64, modules=("all",)):
    _, model = tiny
    return prepare_adapter(
        "a", str(path), model.model, "model", max_rank=max_rank,
        allowed_modules=normalized_modules(list(modules)), dtype=torch.float32,
    )  # fmt: skip


def test_an_adapter_beyond_the_servers_rank_or_modules_is_refused(tiny, tmp_path):
    model_dir, _ = tiny
    path = make_adapter(model_dir, tmp_path / "r8", rank=8, targets=("q_proj", "down_proj"))
    adapter = prepare(tiny, path)
    assert adapter.rank == 8 and adapter.modules == {"q_proj", "down_proj"}
    with pytest.raises(LoraError, match="with rank 8 is incompatible"):
        prepare(tiny, path, max_rank=4)
    with pytest.raises(LoraError, match=r"incompatible .* `--lora-target-modules`"):
        prepare(tiny, path, modules=("q_proj", "k_proj"))


def test_a_path_that_is_no_peft_adapter_is_refused_with_the_reason(tiny, tmp_path):
    model_dir, _ = tiny
    with pytest.raises(LoraError, match="Can't find an adapter directory"):
        prepare(tiny, tmp_path / "missing")
    with pytest.raises(LoraError, match=r"adapter_config\.json"):
        prepare(tiny, model_dir)  # a model directory, not an adapter
    path = make_adapter(model_dir, tmp_path / "a")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="no adapter weights"):
        prepare(tiny, path)


def test_an_adapter_of_another_model_is_refused(tiny, tmp_path):
    model_dir, _ = tiny
    path = make_adapter(model_dir, tmp_path / "a", targets=("q_proj",))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in weights if "lora_A" in k)
    weights[key] = torch.zeros(weights[key].shape[0], 999)  # another hidden size
    save_file(weights, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match=r"lora_A is \(8, 999\), the model needs \[r, 64\]"):
        prepare(tiny, path)


def test_the_runner_is_bare_again_once_its_last_adapter_is_removed(tiny, tmp_path):
    from clawrl.engine.cpu.runner import ModelRunner

    model_dir, _ = tiny
    runner = ModelRunner(model_dir)
    ids = [1, 5, 9, 33, 2, 7]
    with torch.inference_mode():
        before = runner.extend(None, 0, ids).last_logits
        runner.add_adapter("k1", prepare(tiny, make_adapter(model_dir, tmp_path / "a", scale=0.5)))
        tuned = runner.extend(None, 0, ids, "k1").last_logits
        base_beside = runner.extend(None, 0, ids).last_logits
        runner.remove_adapter("k1")
        after = runner.extend(None, 0, ids).last_logits
    assert not torch.allclose(tuned, before, atol=1e-3)
    assert torch.allclose(base_beside, before, atol=1e-5)
    assert torch.equal(after, before)
    assert not any("lora" in name for name, _ in runner.decoder.named_modules())
    # The weights a full update writes into are still the ones the decoder computes with.
    state = {k: v.clone() for k, v in runner.model.state_dict().items()}
    state["model.norm.weight"] *= 2
    runner.load_weights({"model.norm.weight": state["model.norm.weight"]})
    with torch.inference_mode():
        assert not torch.allclose(runner.extend(None, 0, ids).last_logits, before, atol=1e-3)
