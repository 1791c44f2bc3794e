"""The sample a judgement makes of a turn: copied exactly from the turn, then trained (a loss
mask of ones) or masked with its reason, with the teacher's signal when there is one, and the
trained form the at-least-one-sample-per-session rule promotes a masked sample to."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from clawrl.common.proto.records_pb2 import MaskReason, SampleMode
from clawrl.common.records import Sample, Turn
from clawrl.judge.settings import Mode
from clawrl.judge.teacher import TeacherSignal
from clawrl.judge.turns import TurnView

MODES = {"rl": SampleMode.SAMPLE_MODE_BINARY_RL, "opd": SampleMode.SAMPLE_MODE_OPD}
MODES["combine"] = SampleMode.SAMPLE_MODE_COMBINED
TRAINED = MaskReason.MASK_REASON_UNSPECIFIED  # enum lookups are slow on the per-turn path


def promote(sample: Sample) -> Sample:
    """The trained form of a masked 0-scored sample (at-least-one-sample-per-session rule)."""
    promoted = Sample()
    promoted.CopyFrom(sample)
    promoted.mask_reason = MaskReason.MASK_REASON_UNSPECIFIED
    promoted.loss_mask[:] = [1.0] * len(sample.response_ids)
    promoted.promoted = True
    return promoted


def base_sample(view: TurnView, mode: Mode) -> Sample:
    """A sample with everything copied exactly from the turn, not yet scored."""
    turn = view.turn
    now = Timestamp()
    now.GetCurrentTime()
    sample = Sample(
        sample_id=turn.turn_id,
        session_id=turn.session_id,
        turn_index=turn.turn_index,
        policy_version=turn.policy_version,
        mode=MODES[mode],
        prompt_ids=turn.prompt_ids,
        response_ids=turn.response_ids,
        old_logprobs=turn.response_logprobs,
        weight_version=turn.weight_version,
        temperature=turn.temperature,
        top_p=turn.top_p,
        model=turn.model,
        tenant=turn.tenant,
        created_at=now,
    )
    if turn.HasField("finalized_at"):
        sample.turn_finalized_at.CopyFrom(turn.finalized_at)
    return sample


def mixed_policy(turn: Turn) -> bool:
    """A weight sync swapped the weights while the turn was generated. Such a turn is masked,
    not trained: its log-probs are each token's true behaviour log-prob, but no one policy
    version produced it (staleness, per-version rewards and audits key on one), and only the
    few generations still running when a sync's drain budget ends are retracted. The gateway
    records in admitted_policy_version the version the generation started under, so a gateway
    that merely lagged the engines masks nothing."""
    return (
        turn.HasField("admitted_policy_version")
        and turn.admitted_policy_version != turn.policy_version
    )


def set_mask(sample: Sample, reason: int | None) -> Sample:
    """Trained (loss_mask ones) when `reason` is None, else masked with that reason."""
    trained = reason is None
    sample.loss_mask[:] = [1.0 if trained else 0.0] * len(sample.response_ids)
    sample.mask_reason = TRAINED if trained else reason
    return sample


def set_teacher(sample: Sample, signal: TeacherSignal) -> None:
    sample.has_teacher = True
    sample.teacher_logprobs[:] = signal.logprobs
    sample.teacher_top_k = signal.top_k
    sample.teacher_topk_ids[:] = signal.topk_ids
    sample.teacher_topk_logprobs[:] = signal.topk_logprobs
