"""Stacked LoRA (lora_batch.py) against peft's own mixed-batch forward: the same numbers for
every row of a batch mixing the base model and adapters of different ranks and target
modules, exact base rows, and stacks that follow adapters being replaced and removed."""

from __future__ import annotations

import pytest
import torch

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.adapters import prepare_adapter
from clawrl.engine.cpu.runner import ModelRunner
from clawrl.engine.lora import normalized_modules
from tests.integration.engine.lora_adapters import make_adapter

PROMPTS = [[1, 504, 3458, 282], [20, 21, 22, 23], [30, 31, 32, 33], [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    model_dir = resolve_model_dir(ModelSettings(path="smollm2-tiny"))
    root = tmp_path_factory.mktemp("stacked")
    return {
        "a": make_adapter(model_dir, root / "a", rank=8, seed=1, scale=0.5),
        "b": make_adapter(
            model_dir,
            root / "b",
            rank=16,
            alpha=8,
            seed=2,
            scale=0.5,
            targets=("q_proj", "down_proj"),
        ),
        "c": make_adapter(model_dir, root / "c", rank=8, seed=3, scale=0.5),
    }


def load(runner: ModelRunner, key: str, path) -> None:
    runner.add_adapter(key, prepared(runner, path))


def prepared(runner: ModelRunner, path):
    return prepare_adapter(
        "x", str(path), runner.decoder, runner.decoder_prefix, max_rank=64,
        allowed_modules=normalized_modules(["all"]), dtype=runner.dtype,
    )  # fmt: skip


def hidden(runner: ModelRunner, rows: list[str | None], peft: bool) -> torch.Tensor:
    """Last hidden states of PROMPTS as one batch, row i under rows[i]; through peft's
    mixed-batch forward (its own module forwards) or the runner's stacked one."""
    inputs = {"input_ids": torch.tensor(PROMPTS)}
    if not peft:
        return runner._forward(rows, **inputs).last_hidden_state
    from peft.tuners.lora import Linear as LoraLinear

    saved = {}
    for module in runner._peft.modules():
        if isinstance(module, LoraLinear):
            saved[module] = module.__dict__.pop("forward")  # peft's class forward again
    try:
        names = ["__base__" if r is None else runner._names[r] for r in rows]
        return runner._peft(**inputs, adapter_names=names).last_hidden_state
    finally:
        for module, forward in saved.items():
            module.forward = forward


@torch.inference_mode()
def test_a_mixed_batch_gives_peft_numbers_and_exact_base_rows(adapters):
    runner = ModelRunner(resolve_model_dir(ModelSettings(path="smollm2-tiny")))
    base = runner._forward([None] * 4, input_ids=torch.tensor(PROMPTS)).last_hidden_state
    load(runner, "a", adapters["a"])
    load(runner, "b", adapters["b"])
    rows = [None, "a", "b", "a"]
    stacked = hidden(runner, rows, peft=False)
    expected = hidden(runner, rows, peft=True)
    assert torch.allclose(stacked, expected, atol=1e-5)
    assert torch.equal(stacked[0], base[0])  # the base row: nothing added
    assert (stacked[1] - base[1]).abs().max() > 0.1 and (stacked[2] - stacked[1]).abs().max() > 0.1
    assert torch.equal(hidden(runner, [None] * 4, peft=False), base)

    # a pass under some of the loaded adapters reads only their ranks (a's are first, b's
    # last in the stacks; their scalings differ): still each row's own adapter, exactly
    for rows in (["b", None, "b", "b"], ["a", "a", None, "a"], ["b"] * 4):
        assert torch.allclose(hidden(runner, rows, peft=False), hidden(runner, rows, peft=True),
                              atol=1e-5)  # fmt: skip

    # replaced in place (same shape as a): the stacks follow the new tensors
    runner.replace_adapter("a", "c", prepared(runner, adapters["c"]))
    rows = [None, "c", "b", "c"]
    assert torch.allclose(hidden(runner, rows, peft=False), hidden(runner, rows, peft=True),
                          atol=1e-5)  # fmt: skip
    runner.remove_adapter("b")
    rows = ["c", None, "c", None]
    assert torch.allclose(hidden(runner, rows, peft=False), hidden(runner, rows, peft=True),
                          atol=1e-5)  # fmt: skip
    runner.remove_adapter("c")
    assert torch.equal(runner._forward([None] * 4, input_ids=torch.tensor(PROMPTS))
                       .last_hidden_state, base)  # fmt: skip


def merged_passes(runner: ModelRunner) -> int:
    return runner._stacked.merged_passes


@torch.inference_mode()
def test_a_batch_under_one_adapter_runs_on_merged_weights_that_never_go_stale(adapters):
    """After lora_merge_after passes in a row under one adapter alone, such passes run on its
    merged weights with peft's numbers; base rows and other adapters never do; replacing the
    merged adapter under its name or a weight update is seen by the very next pass; other
    adapters coming and going keep the copy."""
    runner = ModelRunner(resolve_model_dir(ModelSettings(path="smollm2-tiny")), lora_merge_after=2)
    base = runner._forward([None] * 4, input_ids=torch.tensor(PROMPTS)).last_hidden_state
    load(runner, "a", adapters["a"])
    load(runner, "b", adapters["b"])
    only_a = ["a"] * 4
    stacked = hidden(runner, only_a, peft=False)  # the first pass in a row: stacked
    assert runner._stacked.merged is None and merged_passes(runner) == 0
    merged = hidden(runner, only_a, peft=False)  # the second: a merged, and run on
    assert runner._stacked.merged == "a" and merged_passes(runner) == 1
    expected = hidden(runner, only_a, peft=True)
    assert torch.allclose(merged, expected, atol=1e-5)
    assert torch.allclose(merged, stacked, atol=1e-5)

    # a mixed batch, a base batch and b alone while a is merged: never its merged weights
    for rows in ([None, "a", "b", "a"], [None] * 4, ["b"] * 4, ["a", "a", "a", None]):
        got = hidden(runner, rows, peft=False)
        assert torch.allclose(got, hidden(runner, rows, peft=True), atol=1e-5), rows
    assert torch.equal(hidden(runner, [None] * 4, peft=False), base)
    assert merged_passes(runner) == 1 and runner._stacked.merged == "a"
    assert torch.allclose(hidden(runner, only_a, peft=False), expected, atol=1e-5)
    assert merged_passes(runner) == 2  # a alone again: on its merged weights at once

    # a replaced by c in a's modules (the same peft name): the next pass has c's numbers
    runner.replace_adapter("a", "c", prepared(runner, adapters["c"]))
    only_c = ["c"] * 4
    expected = hidden(runner, only_c, peft=True)
    assert (expected - merged).abs().max() > 0.1
    for _ in range(3):  # stacked, then merged anew from c's tensors
        assert torch.allclose(hidden(runner, only_c, peft=False), expected, atol=1e-5)
    assert runner._stacked.merges == 2 and merged_passes(runner) == 4

    # a weight update while c is merged: the next pass runs on the new base
    generator = torch.Generator().manual_seed(3)
    changed = {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in runner._state.items()
        if name.endswith(("q_proj.weight", "down_proj.weight"))
    }
    runner.load_weights(changed)
    expected_new = hidden(runner, only_c, peft=True)
    assert (expected_new - expected).abs().max() > 0.1
    for _ in range(3):
        assert torch.allclose(hidden(runner, only_c, peft=False), expected_new, atol=1e-5)
    assert runner._stacked.merges == 3

    # another adapter comes and another goes: c's tensors are untouched, its copy stays
    passes = merged_passes(runner)
    load(runner, "d", adapters["b"])
    runner.remove_adapter("b")
    assert runner._stacked.merged == runner._names["c"]
    assert torch.allclose(hidden(runner, only_c, peft=False), expected_new, atol=1e-5)
    assert runner._stacked.merges == 3 and merged_passes(runner) == passes + 1

    # the merged adapter leaves: its copy goes; the last one out leaves the model bare
    runner.remove_adapter("c")
    assert runner._stacked.merged is None
    assert all(m._clawrl_merged is None for m in runner._stacked._modules)
    runner.remove_adapter("d")
    assert runner._stacked._modules == []


@torch.inference_mode()
def test_a_merge_that_fails_leaves_the_pass_stacked_and_merging_off(adapters, monkeypatch):
    """No memory for the merged copy: the pass runs stacked with peft's numbers, nothing half
    merged is kept, the failure is counted, and no later pass tries again."""
    failures = []
    runner = ModelRunner(
        resolve_model_dir(ModelSettings(path="smollm2-tiny")),
        lora_merge_after=1,
        lora_merge_failed=lambda: failures.append(1),
    )
    load(runner, "a", adapters["a"])
    expected = hidden(runner, ["a"] * 4, peft=True)

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(torch, "mm", no_memory)
    assert torch.allclose(hidden(runner, ["a"] * 4, peft=False), expected, atol=1e-5)
    monkeypatch.undo()
    assert runner._stacked.merged is None and runner._stacked.merge_after == 0
    assert all(m._clawrl_merged is None for m in runner._stacked._modules)
    assert torch.allclose(hidden(runner, ["a"] * 4, peft=False), expected, atol=1e-5)
    assert runner._stacked.merges == 0 and merged_passes(runner) == 0
    assert failures == [1]  # counted once (clawrl_engine_lora_merge_failures_total)
