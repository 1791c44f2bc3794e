"""A context beyond the model's: the torch backend stretches RoPE as the engines do (tested
against a real engine in tests/integration/engine/test_engine_long_context.py); the megatron
backend, which builds RoPE from the model's own config, refuses it at start."""

import pytest

from clawrl.trainer.driver import refuse_stretched_rope
from clawrl.trainer.settings import TrainerSettings


def settings(backend: str, context: int | None) -> TrainerSettings:
    return TrainerSettings(
        model={"path": "smollm2-tiny", "context_length": context}, train={"backend": backend}
    )


def test_megatron_refuses_a_context_beyond_the_models() -> None:
    with pytest.raises(ValueError, match=r"does not stretch RoPE.*beyond the 8192 tokens"):
        refuse_stretched_rope(settings("megatron", 16384))
    refuse_stretched_rope(settings("megatron", 8192))  # within: nothing to stretch
    refuse_stretched_rope(settings("megatron", None))
