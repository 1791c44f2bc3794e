"""The CPU engine in bfloat16: which dtype `auto` picks, the one-row matrix-vector path, and a
bf16 runner keeping the runner's contracts (batched rows as alone, chunked prefill as one pass,
cached prefixes, LoRA adapters) to bf16's precision, with float32 logits out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.adapters import prepare_adapter
from clawrl.engine.cpu.one_row import OneRowLinear, one_row_linears
from clawrl.engine.cpu.runner import (
    KvBatch,
    ModelRunner,
    layer_kv,
    merge_kv,
    native_bf16,
    resolve_dtype,
)
from clawrl.engine.lora import normalized_modules
from clawrl.engine.settings import EngineServerSettings
from tests.integration.engine.lora_adapters import make_adapter

X86_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n"
X86_PLAIN = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
# bf16 keeps 8 bits of mantissa: the tiny model's logits (|logit| <= ~1.2) in bf16 agree with
# float32's and with themselves across batch shapes and chunkings to ~4e-3; 5x that margin.
BF16_ATOL = 0.02


def test_auto_is_bfloat16_only_on_a_cpu_with_native_bf16():
    assert native_bf16(X86_BF16) and native_bf16(ARM_BF16)
    assert not native_bf16(X86_PLAIN) and not native_bf16("")
    assert resolve_dtype("auto", X86_BF16) is torch.bfloat16
    assert resolve_dtype("auto", ARM_BF16) is torch.bfloat16
    assert resolve_dtype("auto", X86_PLAIN) is torch.float32
    assert resolve_dtype("float32", X86_BF16) is torch.float32
    assert resolve_dtype("bfloat16", X86_PLAIN) is torch.bfloat16  # asked for: served, warned
    with pytest.raises(ValueError, match=r"engine\.dtype 'float16'"):
        resolve_dtype("float16")
    assert EngineServerSettings().dtype == "float32"  # exact log-probs unless asked


def test_one_row_goes_through_a_matrix_vector_product_with_linears_numbers():
    torch.manual_seed(0)
    plain = nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    fast = nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    fast.load_state_dict(plain.state_dict())
    assert one_row_linears(nn.Sequential(fast)) == 1 and type(fast) is OneRowLinear
    assert isinstance(fast, nn.Linear)  # peft still wraps it
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    reference = F.linear(x.float(), plain.weight.float(), plain.bias.float())
    got = fast(x)
    assert got.shape == (1, 1, 96) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), reference, atol=0.05)
    assert torch.allclose(fast(x[0, 0]).float(), reference[0, 0], atol=0.05)
    rows = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(fast(rows), plain(rows))  # more rows: linear itself


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.manual_seed(0)
    return ModelRunner(resolve_model_dir(ModelSettings(path="smollm2-tiny")), "bfloat16")


@pytest.fixture(scope="module")
def reference() -> ModelRunner:
    return ModelRunner(resolve_model_dir(ModelSettings(path="smollm2-tiny")), "float32")


@torch.inference_mode()
def test_a_bf16_runner_keeps_bf16_weights_and_kv_and_gives_float32_logits(runner, reference):
    assert runner.dtype is torch.bfloat16
    assert type(runner.lm_head) is OneRowLinear
    assert all(p.dtype is torch.bfloat16 for p in runner.model.parameters())
    assert type(reference.lm_head) is nn.Linear  # float32 gains nothing from it
    prompt = list(range(100, 140))
    whole = runner.extend(None, 0, prompt)
    keys, values = layer_kv(whole.cache)[0]
    assert keys.dtype is torch.bfloat16 and values.dtype is torch.bfloat16
    assert whole.last_logits.dtype is torch.float32
    expected = reference.extend(None, 0, prompt).last_logits
    assert torch.allclose(whole.last_logits, expected, atol=BF16_ATOL)
    assert whole.last_logits.argmax() == expected.argmax()
    logps, _ = runner.logprobs_of(whole.hidden[:-1], prompt[1:], 0)
    exact, _ = reference.logprobs_of(reference.extend(None, 0, prompt).hidden[:-1], prompt[1:], 0)
    assert max(abs(a - b) for a, b in zip(logps, exact, strict=True)) < BF16_ATOL


@torch.inference_mode()
def test_bf16_batched_chunked_and_cached_passes_match_one_pass(runner):
    prompt = list(range(100, 140))
    whole = runner.extend(None, 0, prompt)
    cache = None
    for lo in range(0, len(prompt), 16):
        part = runner.extend(cache, lo, prompt[lo : lo + 16])
        cache = part.cache
    assert torch.allclose(part.last_logits, whole.last_logits, atol=BF16_ATOL)
    prefix = [(k[:, :25].clone(), v[:, :25].clone()) for k, v in layer_kv(whole.cache)]
    rest = runner.extend(prefix, 25, prompt[25:])
    assert torch.allclose(rest.last_logits, whole.last_logits, atol=BF16_ATOL)
    # a batch of three left-padded rows against each row decoded alone (one row: the
    # matrix-vector path; three: the matmul)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]
    kv = None
    for p in prompts:
        row = KvBatch(runner.extend(None, 0, p).cache, torch.ones(1, len(p), dtype=torch.long))
        kv = row if kv is None else merge_kv(kv, row)
    logits = runner.decode(kv, torch.tensor([40, 41, 42]))
    assert logits.dtype is torch.float32
    for i, p in enumerate(prompts):
        alone = KvBatch(runner.extend(None, 0, p).cache, torch.ones(1, len(p), dtype=torch.long))
        expected = runner.decode(alone, torch.tensor([40 + i]))[0]
        assert torch.allclose(logits[i], expected, atol=BF16_ATOL)


@torch.inference_mode()
def test_a_lora_adapter_on_the_bf16_base_gives_float32s_adapted_logits(runner, reference, tmp_path):
    model_dir = resolve_model_dir(ModelSettings(path="smollm2-tiny"))
    path = make_adapter(model_dir, tmp_path / "a", rank=8, seed=3, scale=0.5)
    prompt = [1, 504, 3458, 282, 4649]
    logits = {}
    for name, each in (("bf16", runner), ("f32", reference)):
        adapter = prepare_adapter(
            "a", str(path), each.decoder, each.decoder_prefix, max_rank=64,
            allowed_modules=normalized_modules(["all"]), dtype=each.dtype,
        )  # fmt: skip
        logits[f"{name} base"] = each.extend(None, 0, prompt).last_logits
        each.add_adapter("a", adapter)
        try:
            logits[name] = each.extend(None, 0, prompt, "a").last_logits
        finally:
            each.remove_adapter("a")
    assert (logits["f32"] - logits["f32 base"]).abs().max() > 3 * BF16_ATOL  # it adapts
    assert torch.allclose(logits["bf16"], logits["f32"], atol=BF16_ATOL)  # bf16 adapts alike
    # unloaded: the bare bf16 model again, its one-row linears back in place
    assert type(runner.model.model.layers[0].self_attn.q_proj) is OneRowLinear
    assert torch.equal(runner.extend(None, 0, prompt).last_logits, logits["bf16 base"])
