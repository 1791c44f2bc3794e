"""Adapters loaded on demand: at most max_loras_per_batch adapters resident in the model, the
others in host memory until a request needs one (evicting the least recently used, or first
injected, resident adapter that nothing running uses and that is not pinned), never more than
max_loras_per_batch distinct adapters in one batch, draining so that a waiting adapter gets its
turn, and max_loaded_loras unloading the least recently used adapter. The scheduler is stepped
by hand on the tiny model with real peft adapters, so every batch can be checked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.adapters import ResidentSet, prepare_adapter
from clawrl.engine.cpu.engine import CpuEngine
from clawrl.engine.cpu.runner import ModelRunner
from clawrl.engine.cpu.scheduler import Scheduler
from clawrl.engine.generation import GenerationUpdate
from clawrl.engine.lora import AdapterNotLoaded, LoraRef, LoraRegistry
from clawrl.engine.metrics import EngineMetrics
from clawrl.engine.protocol import GenerateRequest, Limits, generation_request, parse
from clawrl.engine.settings import EngineServerSettings, EngineSettings
from tests.integration.engine.lora_adapters import make_adapter

LIMITS = Limits(
    vocab_size=49152, context_length=8192, default_max_new_tokens=8, eos_token_ids=frozenset()
)
PROMPT = [1, 504, 3458, 282, 4649, 314, 1456, 28]
NAMES = ("a", "b", "c")


def test_lru_evicts_the_least_recently_used_idle_unpinned_adapter():
    slots = ResidentSet(3, "lru")
    for key in ("a", "b", "c"):
        slots.add(key)
    assert slots.full and slots.keys() == ["a", "b", "c"]
    with pytest.raises(RuntimeError, match="no free adapter slot"):
        slots.add("d")
    slots.touch({"a", None})  # a was used since: b is now the least recently used
    assert slots.victim(busy=set()) == "b"
    assert slots.victim(busy={"b"}) == "c"  # a running request's adapter is never evicted
    slots.pinned.add("c")
    assert slots.victim(busy={"b"}) == "a"
    assert slots.victim(busy={"a", "b"}) is None  # all busy or pinned: the request waits


def test_fifo_evicts_the_first_injected_whatever_its_use():
    slots = ResidentSet(2, "fifo")
    slots.add("a")
    slots.add("b")
    slots.touch({"a"})
    assert slots.victim(busy=set()) == "a"
    slots.discard("a")
    slots.add("c")
    assert slots.keys() == ["b", "c"]
    with pytest.raises(ValueError, match="lru or fifo"):
        ResidentSet(2, "lfu")


def test_the_registry_orders_names_by_use_and_never_picks_a_pinned_one():
    registry = LoraRegistry()
    for name, pinned in (("p", True), ("a", False), ("b", False)):
        registry.register(LoraRef(name, f"/ckpt/{name}", pinned))
    assert registry.least_recently_used() == "a"
    registry.release(registry.acquire("a"))  # a request used a: b is now the oldest
    assert registry.least_recently_used() == "b"
    assert list(registry.loaded()) == ["p", "b", "a"]


def test_max_loaded_loras_follows_sglangs_rules():
    with pytest.raises(ValueError, match="greater than or equal to max_loras_per_batch"):
        EngineServerSettings(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"],
                             max_loras_per_batch=4, max_loaded_loras=3)  # fmt: skip
    with pytest.raises(ValueError, match="should not exceed max_loaded_loras"):
        EngineServerSettings(lora_paths=["a=/a", "b=/b", "c=/c"], max_loras_per_batch=2,
                             max_loaded_loras=2)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(ModelSettings(path="smollm2-tiny"))


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("slot-adapters")
    return {
        name: make_adapter(model_dir, root / name, seed=i + 1, scale=0.5)
        for i, name in enumerate(NAMES)
    }


def scheduler(model_dir: Path, adapter_dirs: dict[str, Path], **settings) -> Scheduler:
    """A scheduler over a fresh runner holding the adapters of `adapter_dirs` (keyed by name)."""
    runner = ModelRunner(model_dir)
    serving = EngineServerSettings(enable_lora=True, max_lora_rank=8,
                                   lora_target_modules=["all"], **settings)  # fmt: skip
    s = Scheduler(runner, serving, EngineMetrics("tiny"), lambda ids, skip: "", "v0")
    for name, path in adapter_dirs.items():
        adapter = prepare_adapter(name, str(path), runner.decoder, runner.decoder_prefix,
                                  max_rank=8, allowed_modules={"qkv_proj", "o_proj",
                                  "gate_up_proj", "down_proj"}, dtype=runner.dtype)  # fmt: skip
        s.add_adapter(name, adapter)
    return s


def submit(s: Scheduler, adapter: str | None, max_new_tokens: int = 6):
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                "ignore_eos": True}}  # fmt: skip
    request = generation_request(parse(GenerateRequest, body), None, LIMITS)
    request = dataclasses.replace(request, lora_id=adapter)
    updates: list[GenerationUpdate] = []
    return s.submit(request, updates.append), updates


def done(updates: list[GenerationUpdate]) -> bool:
    return bool(updates) and updates[-1].finish is not None


def output(updates: list[GenerationUpdate]) -> tuple[list[int], list[float]]:
    return [i for u in updates for i in u.new_ids], [lp for u in updates for lp in u.new_logprobs]


def batch_adapters(s: Scheduler) -> set[str | None]:
    return {seq.adapter for seq in s._running + s._prefilling}


def step(s: Scheduler, limit: int) -> set[str | None]:
    """One turn of the loop, checking the limits; -> the adapters of the batch."""
    s._step()
    batch = batch_adapters(s)
    assert len(batch) <= limit, batch
    assert len(s.resident_adapters) <= limit and len(s.runner.adapters) <= limit
    assert batch - {None} <= set(s.resident_adapters)  # what runs is resident
    return batch


@pytest.fixture(scope="module")
def alone(model_dir, adapter_dirs) -> dict[str | None, tuple[list[int], list[float]]]:
    """Each adapter's (and the base model's) greedy output served alone, all resident."""
    s = scheduler(model_dir, adapter_dirs, max_loras_per_batch=8)
    outputs = {}
    with torch.inference_mode():
        for name in (None, *NAMES):
            _, updates = submit(s, name)
            while not done(updates):
                s._step()
            outputs[name] = output(updates)
    assert len({tuple(ids) for ids, _ in outputs.values()}) == 4  # the adapters do differ
    return outputs


@torch.inference_mode()
def test_more_adapters_than_slots_each_request_gets_what_it_gets_alone(
    model_dir, adapter_dirs, alone
):
    s = scheduler(model_dir, adapter_dirs, max_loras_per_batch=2)
    assert s.resident_adapters == ["a", "b"]  # injected while slots were free; c waits in host
    names = ["a", None, "b", "c", "a", "c", None, "b"]
    pending = [submit(s, name) for name in names]
    seen = set()
    for _ in range(200):
        if all(done(updates) for _, updates in pending):
            break
        seen.add(frozenset(step(s, limit=2)))
    for name, (_, updates) in zip(names, pending, strict=True):
        ids, logps = output(updates)
        assert ids == alone[name][0], name
        assert logps == pytest.approx(alone[name][1], abs=1e-5)
    assert {None, "a", "b", "c"} == set().union(*seen)  # all served, two at a time
    m = s.metrics
    assert swaps(s, "replace") >= 1 and swaps(s, "load") == 2  # a, b at start; then reused
    assert m.lora_on_demand_loads._value.get() >= 1
    assert m.lora_evictions.labels(level="resident")._value.get() >= 1
    assert m.lora_slot_waits._value.get() >= 1


def swaps(s: Scheduler, op: str) -> float:
    """How many adapter swaps of kind `op` the scheduler made."""
    samples = s.metrics.lora_swap_seconds.collect()[0].samples
    return sum(x.value for x in samples if x.name.endswith("_count") and x.labels["op"] == op)


@torch.inference_mode()
def test_an_adapter_of_another_shape_is_injected_anew(model_dir, adapter_dirs, tmp_path):
    small = make_adapter(model_dir, tmp_path / "q", rank=4, targets=("q_proj", "v_proj"),
                         seed=9, scale=0.5)  # fmt: skip
    outputs = {}
    for capacity in (8, 2):  # alone (all resident), then replacing a resident one
        s = scheduler(model_dir, {**adapter_dirs, "q": small}, max_loras_per_batch=capacity)
        for name in ("a", "q", "c"):
            _, updates = submit(s, name)
            while not done(updates):
                step(s, limit=capacity)
            outputs.setdefault(name, []).append(output(updates))
    assert all(ids_8 == ids_2 for (ids_8, _), (ids_2, _) in outputs.values())
    assert swaps(s, "evict") == 1  # q could not reuse b's modules (rank 8, all projections)
    assert swaps(s, "replace") == 1  # c took over a's


@torch.inference_mode()
@pytest.mark.parametrize(("policy", "evicted"), [("lru", "b"), ("fifo", "a")])
def test_the_policy_picks_which_idle_adapter_makes_room(model_dir, adapter_dirs, policy, evicted):
    s = scheduler(model_dir, adapter_dirs, max_loras_per_batch=2, lora_eviction_policy=policy)
    assert s.resident_adapters == ["a", "b"]
    for name in ("b", "a"):  # a used last
        _, updates = submit(s, name, max_new_tokens=2)
        while not done(updates):
            step(s, limit=2)
    _, updates = submit(s, "c", max_new_tokens=2)
    while not done(updates):
        step(s, limit=2)
    assert evicted not in s.resident_adapters and "c" in s.resident_adapters


@torch.inference_mode()
def test_a_running_adapter_is_never_evicted(model_dir, adapter_dirs, alone):
    # fifo would evict a (injected first), but a runs: b makes room for c instead.
    s = scheduler(model_dir, adapter_dirs, max_loras_per_batch=2, lora_eviction_policy="fifo")
    _, long = submit(s, "a", max_new_tokens=24)
    step(s, limit=2)
    _, c = submit(s, "c", max_new_tokens=6)
    while not done(c):
        assert "a" in step(s, limit=2) and "a" in s.resident_adapters
    assert s.resident_adapters == ["a", "c"]
    assert output(c)[0] == alone["c"][0]
    assert output(c)[1] == pytest.approx(alone["c"][1], abs=1e-5)
    while not done(long):
        step(s, limit=2)
    assert output(long)[0][: len(alone["a"][0])] == alone["a"][0]


@torch.inference_mode()
@pytest.mark.parametrize("threshold", [0.0, 1e-6])
def test_a_waiting_adapter_gets_a_slot_only_with_draining(model_dir, adapter_dirs, threshold):
    """The base model and a keep a two-slot batch full (new requests for a keep coming); b's
    request waits. Without draining (SGLang's default) it waits as long as a stays busy; with
    it, a takes no new requests once b has waited, and b gets a's slot."""
    s = scheduler(
        model_dir, adapter_dirs, max_loras_per_batch=2, lora_drain_wait_threshold=threshold
    )
    submit(s, None, max_new_tokens=60)
    submit(s, "a", max_new_tokens=3)
    step(s, limit=2)
    _, b = submit(s, "b", max_new_tokens=2)
    turns = 0
    while not done(b) and turns < 20:
        submit(s, "a", max_new_tokens=3)  # a busy tenant
        step(s, limit=2)
        turns += 1
    if threshold:
        assert done(b) and turns < 10
        assert s.metrics.lora_drains._value.get() >= 1
    else:
        assert not b  # never admitted while a stays busy
    assert s.metrics.lora_slot_waits._value.get() >= 1


async def test_max_loaded_loras_unloads_the_least_recently_used_and_a_request_reloads_it(
    adapter_dirs,
):
    settings = EngineSettings(
        model=ModelSettings(path="smollm2-tiny"),
        engine=EngineServerSettings(
            lora_paths=[f"a={adapter_dirs['a']}", f"b={adapter_dirs['b']}"],
            max_loras_per_batch=2,
            max_loaded_loras=2,
        ),
    )
    metrics = EngineMetrics("tiny")
    engine = await CpuEngine.load(settings, metrics)
    try:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}

        async def served(name: str | None) -> list[int]:
            request = generation_request(parse(GenerateRequest, body), None, LIMITS)
            request = dataclasses.replace(request, lora_path=name)
            request = await engine.resolve_adapter(request)
            return (await engine.generate_once(request)).output_ids

        first_a = await served("a")  # a is now used more recently than b
        result = await engine.load_lora_adapter("c", str(adapter_dirs["c"]))
        assert result.success and set(result.loaded_adapters) == {"a", "c"}  # b unloaded
        assert metrics.lora_evictions.labels(level="loaded")._value.get() == 1
        assert await served("b")  # reloaded from its path, evicting the LRU one (a)
        assert set(engine.lora.loaded()) == {"c", "b"}
        assert await served("a") == first_a  # and a comes back the same
        with pytest.raises(AdapterNotLoaded, match="never been loaded: nope"):
            await served("nope")
    finally:
        await engine.close()
