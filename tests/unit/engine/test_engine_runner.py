"""The left-padded KV batch: merging and selecting rows must not change any row's logits."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clawrl.common.models import resolve_model_dir, stretch_config
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.attention import (
    FLASH_OP,
    chunk_attention,
    is_shifted_causal,
    verified_flash_attention,
)
from clawrl.engine.cpu.runner import (
    CheckpointError,
    KvBatch,
    ModelRunner,
    layer_kv,
    merge_kv,
    select_kv,
)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.manual_seed(0)
    return ModelRunner(resolve_model_dir(ModelSettings(path="smollm2-tiny")))


def prefill(runner: ModelRunner, prompts: list[list[int]]) -> tuple[KvBatch, torch.Tensor]:
    """Prompts prefilled one by one and merged into one left-padded batch, and their logits."""
    kv, logits = None, []
    for prompt in prompts:
        result = runner.extend(None, 0, prompt)
        row = KvBatch(result.cache, torch.ones(1, len(prompt), dtype=torch.long))
        kv = row if kv is None else merge_kv(kv, row)
        logits.append(result.last_logits)
    assert kv is not None
    return kv, torch.stack(logits)


def alone(runner: ModelRunner, prompt: list[int], steps: list[int]) -> torch.Tensor:
    """Logits after feeding `steps` one by one to a batch of just this prompt."""
    kv, logits = prefill(runner, [prompt])
    for token in steps:
        logits = runner.decode(kv, torch.tensor([token]))
    return logits[0]


@torch.inference_mode()
def test_merged_and_selected_rows_match_unbatched_logits(runner):
    a, b, c = [5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]
    first, _ = prefill(runner, [a, b])
    second, _ = prefill(runner, [c])
    assert first.width == 7 and second.width == 4
    kv = merge_kv(first, second)
    assert kv.mask.tolist()[2] == [0, 0, 0, 1, 1, 1, 1]
    logits = runner.decode(kv, torch.tensor([40, 41, 42]))
    for row, prompt in enumerate((a, b, c)):
        expected = alone(runner, prompt, [40 + row])
        assert torch.allclose(logits[row], expected, atol=1e-4)
    # dropping row 0 (the longest) frees the columns only it used
    kv = select_kv(kv, [1, 2])
    assert kv.width == 5 and kv.mask.sum(dim=-1).tolist() == [3, 5]
    logits = runner.decode(kv, torch.tensor([50, 51]))
    assert torch.allclose(logits[0], alone(runner, b, [41, 50]), atol=1e-4)
    assert torch.allclose(logits[1], alone(runner, c, [42, 51]), atol=1e-4)


@torch.inference_mode()
def test_chunked_and_prefix_reusing_prefills_match_one_shot(runner):
    prompt = list(range(100, 140))
    whole = runner.extend(None, 0, prompt)
    # in chunks of 16, 16, 8: each chunk attends to the KV of the earlier ones
    cache, hidden = None, []
    for lo in range(0, len(prompt), 16):
        part = runner.extend(cache, lo, prompt[lo : lo + 16])
        cache = part.cache
        hidden.append(part.hidden)
    assert torch.allclose(torch.cat(hidden), whole.hidden, atol=1e-4)
    assert torch.allclose(part.last_logits, whole.last_logits, atol=1e-4)
    # a cached prefix's KV (as the prefix cache keeps it: [H_kv, n, D] per layer) in place of
    # prefilling it again
    prefix = [(k[:, :25].clone(), v[:, :25].clone()) for k, v in layer_kv(whole.cache)]
    rest = runner.extend(prefix, 25, prompt[25:])
    assert torch.allclose(rest.hidden, whole.hidden[25:], atol=1e-4)
    assert torch.allclose(rest.last_logits, whole.last_logits, atol=1e-4)


@torch.inference_mode()
def test_logprobs_of_match_the_next_token_distribution(runner):
    prompt = [5, 6, 7, 8]
    result = runner.extend(None, 0, prompt)
    logps, tops = runner.logprobs_of(result.hidden[:-1], prompt[1:], 2)
    assert len(logps) == 3 and all(len(top) == 2 for top in tops)
    prefix = runner.extend(None, 0, prompt[:3]).last_logits
    assert logps[2] == pytest.approx(float(torch.log_softmax(prefix, -1)[8]), abs=1e-4)


def test_a_longer_context_scales_rope_and_says_so():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_dir(ModelSettings(path="smollm2-tiny")))
    trained = config.max_position_embeddings
    assert stretch_config(config, None, "yarn") is None
    assert stretch_config(config, trained, "yarn") is None
    message = stretch_config(config, 4 * trained, "yarn")
    assert message is not None and "yarn" in message and "quality" in message
    assert config.max_position_embeddings == 4 * trained
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["factor"] == 4.0
    assert config.rope_parameters["original_max_position_embeddings"] == trained
    assert config.rope_parameters["rope_theta"] == 100000.0  # the model's base is kept
    # A stretched config (an exported checkpoint) is stretched from what it was trained on.
    assert stretch_config(config, 4 * trained, "yarn") is not None
    assert config.rope_parameters["factor"] == 4.0
    stretch_config(config, 2 * trained, "linear")
    assert config.rope_parameters["factor"] == 2.0
    assert config.rope_parameters["original_max_position_embeddings"] == trained


def test_checkpoints_must_match_names_and_shapes(runner):
    state = {name: torch.zeros(shape) for name, shape in runner.shapes.items()}
    state.pop("lm_head.weight", None)  # tied to the embeddings: may be left out
    runner.check_checkpoint(state)
    name = next(iter(state))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        runner.check_checkpoint({**state, name: torch.zeros(3)})
    with pytest.raises(CheckpointError, match="unknown"):
        runner.check_checkpoint({**state, "extra.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="missing"):
        runner.check_checkpoint({k: v for k, v in state.items() if k != name})


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory mappings of `path` (Linux /proc)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]) == path:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def test_weights_live_in_process_memory_not_on_the_checkpoint_file():
    """A weight update writes into every parameter: on the file mapping from_pretrained leaves,
    the first one paid ~1 s of copy-on-write faults inside a sync's pause."""
    model_dir = resolve_model_dir(ModelSettings(path="smollm2-tiny"))
    runner = ModelRunner(model_dir)
    mapped = file_mappings((model_dir / "model.safetensors").resolve())
    on_file = [
        name
        for name, tensor in runner.model.state_dict().items()
        if any(start <= tensor.data_ptr() < end for start, end in mapped)
    ]
    assert on_file == []


@torch.inference_mode()
def test_prefill_chunks_and_decode_steps_write_into_the_kv_in_place(runner):
    """No copy of the whole KV per chunk or per step: the layers' keys stay views of one buffer
    while its room lasts (DynamicLayer concatenated everything again each time), and a batch
    whose KV another function replaced (merge_kv) gets a new buffer, with the same logits."""
    prompt = list(range(200, 300))
    first = runner.extend(None, 0, prompt[:40])
    storage = [layer.keys.data_ptr() for layer in first.cache.layers]
    part = runner.extend(first.cache, 40, prompt[40:])
    assert [layer.keys.data_ptr() for layer in part.cache.layers] == storage
    whole = runner.extend(None, 0, prompt)
    assert torch.allclose(part.hidden, whole.hidden[40:], atol=1e-4)

    kv = KvBatch(part.cache, torch.ones(1, len(prompt), dtype=torch.long))
    runner.decode(kv, torch.tensor([7]))
    assert [layer.keys.data_ptr() for layer in kv.cache.layers] == storage
    assert kv.cache.layers[0].keys.shape[-2] == len(prompt) + 1

    other = runner.extend(None, 0, [5, 6, 7])
    kv = merge_kv(kv, KvBatch(other.cache, torch.ones(1, 3, dtype=torch.long)))
    logits = runner.decode(kv, torch.tensor([8, 9]))
    assert torch.allclose(logits[0], alone(runner, prompt, [7, 8]), atol=1e-4)
    assert torch.allclose(logits[1], alone(runner, [5, 6, 7], [9]), atol=1e-4)
    merged = [layer.keys.data_ptr() for layer in kv.cache.layers]
    runner.decode(kv, torch.tensor([10, 11]))
    assert [layer.keys.data_ptr() for layer in kv.cache.layers] == merged


@torch.inference_mode()
def test_a_chunk_after_cached_tokens_attends_without_repeating_the_kv_or_a_mask(
    runner, monkeypatch
):
    """A prefill chunk after cached tokens attends in two unmasked passes (chunk_attention):
    transformers' repeat_kv (a copy of the whole KV per query head, chunk and layer) is never
    called, nor SDPA with the [chunk, cached + chunk] mask (it adds a mask block per key
    block: ~20% slower at 4k tokens), and the numbers are those of one pass."""
    import transformers.integrations.sdpa_attention as sdpa

    import clawrl.engine.cpu.attention as attention_module

    assert runner.config.num_attention_heads > runner.config.num_key_value_heads
    prompt = list(range(300, 380))
    whole = runner.extend(None, 0, prompt)
    first = runner.extend(None, 0, prompt[:30])

    def refuse(what):
        def fail(*_args, **_kwargs):
            raise AssertionError(what)

        return fail

    monkeypatch.setattr(sdpa, "repeat_kv", refuse("repeat_kv copied the KV"))
    monkeypatch.setattr(attention_module, "sdpa_attention_forward", refuse("a masked SDPA pass"))
    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse("a masked SDPA pass"))
    rest = runner.extend(first.cache, 30, prompt[30:])
    assert torch.allclose(rest.hidden, whole.hidden[30:], atol=1e-5)
    assert torch.allclose(rest.last_logits, whole.last_logits, atol=1e-5)


@torch.inference_mode()
def test_without_the_private_flash_op_a_chunk_takes_masked_sdpa_with_the_same_numbers(
    runner, monkeypatch
):
    """A torch whose private CPU flash op is missing or answers otherwise (it did not verify at
    import) still prefills chunks after cached tokens: through public, masked SDPA."""
    import clawrl.engine.cpu.attention as attention_module

    monkeypatch.setattr(attention_module, "_flash_attention", None)
    masked = []
    sdpa = attention_module.sdpa_attention_forward

    def counted(*args, **kwargs):
        masked.append(args[4] is not None)  # the attention mask
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention_module, "sdpa_attention_forward", counted)
    prompt = list(range(300, 380))
    whole = runner.extend(None, 0, prompt)
    first = runner.extend(None, 0, prompt[:30])
    masked.clear()
    rest = runner.extend(first.cache, 30, prompt[30:])
    assert masked and all(masked)
    assert torch.allclose(rest.hidden, whole.hidden[30:], atol=1e-5)
    assert torch.allclose(rest.last_logits, whole.last_logits, atol=1e-5)


def test_the_private_flash_op_is_used_only_when_it_agrees_with_public_sdpa():
    real = getattr(torch.ops.aten, FLASH_OP)
    assert verified_flash_attention(real) is real  # the pinned torch has a good one

    def renamed(*_args, **_kwargs):
        raise RuntimeError("unknown argument 'scale'")

    def no_lse(query, key, value, is_causal=False, scale=None):
        out, lse = real(query, key, value, is_causal=is_causal, scale=scale)
        return out, torch.zeros_like(lse)

    def ignores_causal(query, key, value, is_causal=False, scale=None):
        return real(query, key, value, is_causal=False, scale=scale)

    for broken in (None, renamed, no_lse, ignores_causal):
        assert verified_flash_attention(broken) is None


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_chunk_attention_is_sdpa_under_the_shifted_causal_mask(dtype, atol):
    torch.manual_seed(1)
    past, length, heads, kv_heads, dim = 100, 37, 9, 3, 16
    query = torch.randn(1, length, heads, dim, dtype=dtype).transpose(1, 2)  # as a layer has it
    key, value = torch.randn(2, 1, kv_heads, past + length, dim, dtype=dtype)
    mask = torch.ones(length, past + length, dtype=torch.bool).tril(past)
    expected = F.scaled_dot_product_attention(query, key, value, mask, scale=0.3, enable_gqa=True)
    got = chunk_attention(query, key, value, past, scale=0.3)
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.allclose(got.float(), expected.float(), atol=atol)


def test_only_the_shifted_causal_mask_takes_the_unmasked_passes():
    past, length = 6, 4
    mask = torch.ones(length, past + length, dtype=torch.bool).tril(past)[None, None]
    assert is_shifted_causal(mask, past)
    assert is_shifted_causal(mask, past)  # the verdict cached for this mask
    assert not is_shifted_causal(mask, past - 1)
    padded = mask.clone()
    padded[..., 0] = False  # a left-padded row
    assert not is_shifted_causal(padded, past)
    wider = torch.ones(length, past + length, dtype=torch.bool).tril(past + 1)[None, None]
    assert not is_shifted_causal(wider, past)
    assert not is_shifted_causal(mask.expand(2, 1, -1, -1), past)
    assert not is_shifted_causal(None, past)


@torch.inference_mode()
def test_a_chunk_computes_its_logits_only_when_asked(runner, monkeypatch):
    """Only a prompt's last chunk needs next-token logits: the LM head (a pass over its whole
    weight for one row) does not run for the chunks before it."""
    rows = []
    head = runner.lm_head

    def counted(hidden):
        rows.append(tuple(hidden.shape))
        return head(hidden)

    monkeypatch.setattr(runner, "lm_head", counted)
    first = runner.extend(None, 0, [11, 12, 13])
    last = runner.extend(first.cache, 3, [14, 15])
    assert rows == []
    logits = last.last_logits
    assert last.last_logits is logits and rows == [(runner.config.hidden_size,)]
    monkeypatch.setattr(runner, "lm_head", head)
    assert torch.allclose(
        logits, runner.extend(None, 0, [11, 12, 13, 14, 15]).last_logits, atol=1e-5
    )
