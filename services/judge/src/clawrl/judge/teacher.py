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


def narrow_topk(ids: Sequence[int], logprobs: Sequence[float], k_from: int, k_to: int):
    """[T * k_from] row-major top-K ids and log-probs -> the first k_to of each row
    ([T * k_to]; rows are sorted most likely first)."""
    if k_to > k_from:
        raise ValueError(f"cannot narrow top-{k_from} rows to {k_to}")
    rows = range(0, len(ids), k_from)
    return (
        [i for r in rows for i in ids[r : r + k_to]],
        [lp for r in rows for lp in logprobs[r : r + k_to]],
    )


def merge_signals(signals: Sequence[TeacherSignal], choice: Sequence[int]) -> TeacherSignal:
    """signals: N teacher signals over one response (same top_k); choice: [T] candidate per
    token -> one signal whose token t (log-prob and top-K row) is candidate choice[t]'s."""
    k = signals[0].top_k
    logprobs = [signals[c].logprobs[t] for t, c in enumerate(choice)]
    ids = [i for t, c in enumerate(choice) for i in signals[c].topk_ids[t * k : (t + 1) * k]]
    lps = [v for t, c in enumerate(choice) for v in signals[c].topk_logprobs[t * k : (t + 1) * k]]
    return TeacherSignal(logprobs, k, ids, lps)


class Teacher:
    """The teacher engine (the judge engine, or the policy engine's base weights: requests carry
    no adapter) scoring the recorded response after the hinted prompt, rendered with the
    POLICY's template and tools. `student`: the policy engine, whose base weights stand in for
    the student when hint candidates are selected by top-K agreement (the judge cannot reach
    the trainer's current weights; they start equal to the base and stay close to it)."""

    def __init__(
        self,
        engine: SGLangClient,
        policy_renderer: ChatRenderer,
        top_k: int,
        student: SGLangClient | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = policy_renderer
        self.top_k = top_k
        self.student = student

    def hinted_prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, hint: str
    ) -> list[int]:
        return self.renderer.render_ids(inject_hint(messages, hint), tools)

    async def score(
        self, prompt_ids: list[int], response_ids: Sequence[int], top_k: int | None = None
    ) -> TeacherSignal:
        k = self.top_k if top_k is None else top_k
        reply = await self.engine.generate(teacher_request(prompt_ids, response_ids, k))
        return teacher_from_meta(reply.get("meta_info") or {}, response_ids, k)

    async def student_topk(
        self, prompt_ids: list[int], response_ids: Sequence[int], top_k: int
    ) -> list[int]:
        """[T * top_k] ids of the student's (base policy's) top-K at each response token, on
        the turn's own prompt."""
        if self.student is None:
            raise ValueError("no policy engine to read the student's top-K from")
        reply = await self.student.generate(teacher_request(prompt_ids, response_ids, top_k))
        return teacher_from_meta(reply.get("meta_info") or {}, response_ids, top_k).topk_ids
