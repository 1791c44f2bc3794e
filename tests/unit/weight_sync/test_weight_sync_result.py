"""A sync's result survives the results stream (LoRA fields included) and says what it did."""

from clawrl.trainer.weight_sync.adapter_sync import POLICY_ADAPTER
from clawrl.trainer.weight_sync.result import SyncResult


def test_a_lora_result_round_trips_and_its_summary_says_no_pause():
    result = SyncResult(
        version=7,
        outcome="ok",
        load_s=0.42,
        adapter="policy-v7",
        switch_s=0.0031,
        unloaded=2,
        kept=1,
        gateways=2,
        engines=2,
    )
    fields = {key.encode(): value.encode() for key, value in result.fields().items()}
    assert SyncResult.from_fields(fields) == result
    assert result.summary() == (
        "weight sync to v7 (adapter policy-v7): ok; no pause; load 0.420s, switch 0.0031s, "
        "2 old adapter(s) unloaded, 1 kept over 2 gateway(s) and 2 engine(s)"
    )


def test_a_full_weight_summary_keeps_its_pause_figures():
    result = SyncResult(version=3, outcome="failed", reason="engine down", pause_s=0.5)
    assert result.summary().startswith("weight sync to v3: failed (engine down); pause 0.500s")


def test_only_policy_adapters_are_the_syncs_to_unload():
    assert POLICY_ADAPTER.fullmatch("policy-v12")
    assert not POLICY_ADAPTER.fullmatch("tenant-a")
    assert not POLICY_ADAPTER.fullmatch("policy-v12-old")
