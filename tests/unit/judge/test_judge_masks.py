"""Turns the judge masks whatever the signal: a next state from a request whose history did not
extend the turn (issue 30: it is not known to answer this reply), and a retry's orphan (the
client retried the request and never used the reply)."""

from __future__ import annotations

import json

from clawrl.common.proto.records_pb2 import FinalizeReason, MaskReason, Turn
from clawrl.judge.core import Judge
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.rewards import load_reward_fn
from clawrl.judge.turns import TurnView


def turn(history_mismatch: bool) -> Turn:
    t = Turn(turn_id="s:0:0", session_id="s", messages_json='[{"role":"user","content":"Hi"}]',
             response_ids=[5, 6], response_logprobs=[-0.1, -0.2], response_text="+1",
             history_mismatch=history_mismatch)  # fmt: skip
    t.next_state_messages_json.append(json.dumps({"role": "user", "content": "Thanks!"}))
    return t


async def test_a_mismatched_history_masks_the_turn() -> None:
    metrics = JudgeMetrics()
    reward_fn = load_reward_fn("tests.integration.judge.plugins:by_response")
    judge = Judge(mode="rl", metrics=metrics, reward_fn=reward_fn)
    trained = await judge.judge(TurnView(turn(False)))
    masked = await judge.judge(TurnView(turn(True)))
    assert trained.sample.reward == 1.0 and trained.effective
    assert masked.sample.mask_reason == MaskReason.MASK_REASON_HISTORY_MISMATCH
    assert set(masked.sample.loss_mask) == {0.0} and masked.sample.reward == 0.0
    assert metrics.masked.labels("MASK_REASON_HISTORY_MISMATCH")._value.get() == 1


async def test_a_retry_orphan_is_masked_though_its_reward_fn_scores_it() -> None:
    """The reward_fn scores the reply alone (+1, no next state needed): the orphan is published
    masked, not trained beside the retry's own turn."""
    metrics = JudgeMetrics()
    reward_fn = load_reward_fn("tests.integration.judge.plugins:by_response")
    judge = Judge(mode="rl", metrics=metrics, reward_fn=reward_fn)
    orphan = turn(False)
    del orphan.next_state_messages_json[:]
    orphan.finalize_reason = FinalizeReason.FINALIZE_REASON_RETRY_ORPHAN
    masked = await judge.judge(TurnView(orphan))
    assert masked.sample.mask_reason == MaskReason.MASK_REASON_RETRY_ORPHAN
    assert set(masked.sample.loss_mask) == {0.0} and masked.sample.reward == 0.0
    assert masked.audit["finalize_reason"] == "FINALIZE_REASON_RETRY_ORPHAN"
    assert masked.audit["mask_reason"] == "MASK_REASON_RETRY_ORPHAN"
    assert metrics.masked.labels("MASK_REASON_RETRY_ORPHAN")._value.get() == 1


async def test_a_probe_is_masked_though_its_reward_fn_scores_it() -> None:
    """A probe turn (X-Turn-Type: probe, the chart's `helm test` hook) is recorded to check the
    recording path, never trained: whatever a reward_fn that scores the reply alone says, and
    with a next state too (issue 30)."""
    reward_fn = load_reward_fn("tests.integration.judge.plugins:by_response")
    metrics = JudgeMetrics()
    judge = Judge(mode="rl", metrics=metrics, reward_fn=reward_fn)
    assert (await judge.judge(TurnView(turn(False)))).effective  # the same turn, no probe
    probe = turn(False)
    probe.probe = True
    masked = await judge.judge(TurnView(probe))
    assert masked.sample.mask_reason == MaskReason.MASK_REASON_PROBE
    assert set(masked.sample.loss_mask) == {0.0} and masked.sample.reward == 0.0
    assert not masked.effective and masked.audit["mask_reason"] == "MASK_REASON_PROBE"
    assert metrics.masked.labels("MASK_REASON_PROBE")._value.get() == 1
