"""Fluency kept: the BASE model's mean negative log-likelihood per token of a version's held-out
replies (`clawrl eval --engine-url`), so that a policy which pleases the user's check by
collapsing into odd text shows it as a rising NLL beside its held-out score.

The policy engine scores prompt + reply ids without an adapter (`/generate`, `max_new_tokens: 0`,
`return_logprob`). `logprob_start_len` is one position BEFORE the reply: SGLang aligns
`input_token_logprobs` with `input_ids[logprob_start_len:]` but pads entry 0 with None (it does
not compute the log-prob of the token at the start position), so starting at the reply would lose
its first token; that entry, the last prompt token's, is dropped (as the judge's teacher does).
The prompt is the question rendered with the model's chat template, the reply its text tokenised
again: a measure of the text, the same for every version.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clawrl.common.chat import ChatRenderer
from clawrl.common.settings import ModelSettings
from clawrl.common.sglang_client import EngineError, SGLangClient, sampling_params


class FluencyError(RuntimeError):
    """The engine could not score a reply, or its log-probs do not line up with the reply."""


@dataclass(frozen=True)
class Fluency:
    nll: float  # total negative log-likelihood of the replies' tokens under the base model
    tokens: int  # reply tokens scored

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens if self.tokens else 0.0


@functools.cache
def renderer_for(model: str) -> ChatRenderer:
    """The chat renderer of a prepared model or a model directory (loaded once per process)."""
    return ChatRenderer.from_settings(ModelSettings(path=model))


def nll_request(prompt_ids: Sequence[int], reply_ids: Sequence[int]) -> dict[str, Any]:
    """The /generate payload that scores `reply_ids` after `prompt_ids` on the base weights."""
    if not prompt_ids:
        raise ValueError("scoring a reply needs a non-empty prompt")
    return {
        "input_ids": [*prompt_ids, *reply_ids],
        "sampling_params": sampling_params(max_new_tokens=0, temperature=0.0),
        "return_logprob": True,
        "logprob_start_len": len(prompt_ids) - 1,
    }


def reply_nll(meta: dict[str, Any], reply_ids: Sequence[int]) -> float:
    """The summed NLL of the reply in /generate's `meta_info` for an `nll_request` (entries
    `[logprob, token_id, text]`, the first one for the last prompt token and dropped);
    FluencyError unless the rest cover exactly the reply ids."""
    entries = (meta.get("input_token_logprobs") or [])[1:]
    if [int(e[1]) for e in entries] != list(reply_ids):
        raise FluencyError(
            f"engine returned log-probs for {len(entries)} tokens that are not the "
            f"{len(reply_ids)} reply ids"
        )
    if any(e[0] is None for e in entries):
        raise FluencyError("engine returned a null log-prob inside the reply")
    return -sum(float(e[0]) for e in entries)


async def base_fluency(
    engine_url: str,
    model: str,
    exchanges: Sequence[tuple[str, str]],
    *,
    concurrency: int = 4,
) -> Fluency:
    """The base model's NLL over the replies of (question, reply) exchanges, scored by the
    policy engine at `engine_url` with no adapter; `model` names the tokenizer (a prepared model
    or a directory). Empty replies add nothing."""
    renderer = renderer_for(model)
    engine = SGLangClient(engine_url)
    gate = asyncio.Semaphore(concurrency)

    async def score(question: str, reply: str) -> Fluency:
        reply_ids = renderer.tokenizer.encode(reply, add_special_tokens=False)
        if not reply_ids:
            return Fluency(0.0, 0)
        prompt_ids = renderer.render_ids([{"role": "user", "content": question}])
        async with gate:
            try:
                answer = await engine.generate(nll_request(prompt_ids, reply_ids))
            except EngineError as exc:
                raise FluencyError(f"the engine did not score a reply: {exc}") from exc
        return Fluency(reply_nll(answer.get("meta_info") or {}, reply_ids), len(reply_ids))

    try:
        # Every request finishes before the client closes, even when one of them failed.
        found = await asyncio.gather(*(score(q, r) for q, r in exchanges), return_exceptions=True)
    finally:
        await engine.aclose()
    for result in found:
        if isinstance(result, BaseException):
            raise result
    return Fluency(sum(f.nll for f in found), sum(f.tokens for f in found))
