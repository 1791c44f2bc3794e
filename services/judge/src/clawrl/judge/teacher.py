"""Teacher log-probs for on-policy distillation: the judge engine scores the RECORDED response
ids after the hinted prompt (`max_new_tokens: 0`, `return_logprob`), so there is exactly one
teacher log-prob per response token and no text is ever re-tokenised.

`logprob_start_len` is one position BEFORE the response: SGLang aligns `input_token_logprobs`
with `input_ids[logprob_start_len:]` but always pads entry 0 with None (it does not compute the
log-prob of the token at the start position), so starting at the response would lose the first
response token. The entry of the last prompt token is dropped, whatever an engine puts there."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clawrl.common.chat import ChatRenderer
from clawrl.common.sglang_client import SGLangClient, sampling_params
from clawrl.judge.hints import inject_hint


class TeacherMismatch(ValueError):
    """The engine's prompt log-probs do not line up with the response ids."""


@dataclass(frozen=True)
class TeacherSignal:
    """Teacher log-probs over the response (and optionally its top-K per token).

    logprobs: [T]; topk_ids, topk_logprobs: [T * top_k] row-major."""

    logprobs: list[float]
    top_k: int = 0
    topk_ids: list[int] = field(default_factory=list)
    topk_logprobs: list[float] = field(default_factory=list)


def teacher_request(prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int) -> dict:
    """The /generate payload that scores `response_ids` after `prompt_ids` without generating
    (log-probs from the last prompt token on, see the module docstring)."""
    if not prompt_ids:
        raise ValueError("the teacher needs a non-empty prompt")
    payload: dict[str, Any] = {
        "input_ids": [*prompt_ids, *response_ids],
        "sampling_params": sampling_params(max_new_tokens=0, temperature=0.0),
        "return_logprob": True,
        "logprob_start_len": len(prompt_ids) - 1,
    }
    if top_k:
        payload["top_logprobs_num"] = top_k
    return payload


def teacher_from_meta(
    meta: dict[str, Any], response_ids: Sequence[int], top_k: int
) -> TeacherSignal:
    """The teacher signal in /generate's `meta_info` for a `teacher_request` (entries are
    `[logprob, token_id, text]`, the first one for the last prompt token and dropped);
    TeacherMismatch unless the rest cover exactly the response ids.

    meta.input_token_logprobs: [1 + T]; meta.input_top_logprobs: [1 + T][>= top_k]"""
    entries = (meta.get("input_token_logprobs") or [])[1:]
    ids = [int(e[1]) for e in entries]
    if ids != list(response_ids):
        raise TeacherMismatch(
            f"engine returned prompt log-probs for {len(ids)} tokens that are not the "
            f"{len(response_ids)} response ids"
        )
    if any(e[0] is None for e in entries):
        raise TeacherMismatch("engine returned a null log-prob inside the response")
    signal = TeacherSignal(logprobs=[float(e[0]) for e in entries])
    if not top_k:
        return signal
    rows = (meta.get("input_top_logprobs") or [])[1:]
    if len(rows) != len(entries) or any(row is None or len(row) < top_k for row in rows):
        raise TeacherMismatch(f"engine returned no top-{top_k} log-probs for every response token")
    topk_ids = [int(e[1]) for row in rows for e in row[:top_k]]
    topk_lps = [float(e[0]) for row in rows for e in row[:top_k]]
    return TeacherSignal(signal.logprobs, top_k, topk_ids, topk_lps)


class Teacher:
    """The judge engine as teacher: renders the hinted prompt with the POLICY's template and
    tools, then scores the recorded response."""

    def __init__(self, engine: SGLangClient, policy_renderer: ChatRenderer, top_k: int) -> None:
        self.engine = engine
        self.renderer = policy_renderer
        self.top_k = top_k

    def hinted_prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, hint: str
    ) -> list[int]:
        return self.renderer.render_ids(inject_hint(messages, hint), tools)

    async def score(self, prompt_ids: list[int], response_ids: Sequence[int]) -> TeacherSignal:
        reply = await self.engine.generate(teacher_request(prompt_ids, response_ids, self.top_k))
        return teacher_from_meta(reply.get("meta_info") or {}, response_ids, self.top_k)
