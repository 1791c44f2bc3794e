"""Stream records: stable ids, lossless round trip, and clear rejection of foreign entries."""

import pytest

from clawrl.common.records import RecordError, Sample, Turn, decode_entry, encode_entry, turn_id


def test_turn_round_trips_through_a_stream_entry() -> None:
    turn = Turn(
        turn_id=turn_id("sess-1", "0a1b2c", 3),
        session_id="sess-1",
        turn_index=3,
        prompt_ids=[1, 2, 3],
        response_ids=[7, 8],
        response_logprobs=[-0.5, -1.25],
        policy_version=12,
        next_state_json='{"role": "user", "content": "thanks"}',
    )
    fields = encode_entry(turn)
    assert fields["id"] == b"sess-1:0a1b2c:3"
    assert fields["type"] == b"clawrl.v1.Turn"
    # Redis hands back bytes keys.
    decoded = decode_entry({k.encode(): v for k, v in fields.items()}, Turn)
    assert decoded == turn


def test_a_sample_entry_is_not_read_as_a_turn() -> None:
    fields = encode_entry(Sample(sample_id="s:0"))
    with pytest.raises(RecordError, match=r"expected a clawrl\.v1\.Turn"):
        decode_entry(fields, Turn)


def test_garbage_data_is_a_record_error() -> None:
    with pytest.raises(RecordError, match="undecodable"):
        decode_entry({"type": b"clawrl.v1.Turn", "data": b"\xff\xff\xff"}, Turn)
