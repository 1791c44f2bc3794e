"""The end-to-end learning test's reward plug-in (loaded by the judge as
`tests.e2e.learning_reward:preferred_half`).

A preference the random tiny model does not have: replies made of tokens from one half of the
vocabulary, the half whose initial embedding lies on the positive side of its first coordinate.
The random model samples both halves alike (mean reward ~0); the half is one direction of the
embedding space, so a policy can learn it in a few steps, and the reward is dense (every token
counts), so a short run shows it.
"""

from __future__ import annotations

import functools

import numpy as np
from safetensors.numpy import load_file

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings


@functools.cache
def preferred(model: str) -> np.ndarray:
    """[V] bool: the preferred half of the vocabulary."""
    tensors = load_file(str(resolve_model_dir(ModelSettings(path=model)) / "model.safetensors"))
    return tensors["model.embed_tokens.weight"][:, 0] > 0


def preferred_half(turn, *, model: str = "smollm2-tiny") -> float | None:
    """2 * (share of response tokens in the preferred half) - 1, in [-1, 1]."""
    ids = np.asarray(turn.turn.response_ids, dtype=np.int64)
    if ids.size == 0:
        return None
    return float(2.0 * preferred(model)[ids].mean() - 1.0)
