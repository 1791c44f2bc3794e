"""SGLang's /generate reply built from a GenerationState.

Streaming has SGLang's two modes. Cumulative (the default): every event carries the `text`,
`output_ids` and `meta_info.output_token_logprobs` so far. Incremental
(`--incremental-streaming-output`): every event carries only what is new since the previous
one (prompt log-probs come once, in the first). Either way `completion_tokens` counts every
token so far and the last event has a non-null `finish_reason`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawrl.engine.generation import GenerationState, TopLogprobs

TokenText = Callable[[int], str]


@dataclass
class Sent:
    """How much of a state earlier stream events carried (incremental mode)."""

    ids: int = 0
    text: int = 0

    def advance(self, state: GenerationState) -> None:
        self.ids, self.text = len(state.output_ids), len(state.text)


def logprob_entries(
    logps: list[float | None], ids: list[int], token_text: TokenText | None
) -> list[list[Any]]:
    """SGLang's `[[logprob, token_id, text|None], ...]`."""
    return [
        [lp, tid, token_text(tid) if token_text else None]
        for lp, tid in zip(logps, ids, strict=True)
    ]


def top_entries(tops: list[TopLogprobs | None], token_text: TokenText | None) -> list[Any]:
    return [
        None
        if top is None
        else [[lp, tid, token_text(tid) if token_text else None] for lp, tid in top]
        for top in tops
    ]


def generate_response(
    state: GenerationState, token_text: TokenText, since: Sent | None = None
) -> dict:
    """`{text, output_ids, meta_info}` as SGLang's /generate returns it: everything so far, or
    only what came after `since` (incremental streaming)."""
    req = state.request
    first = since.ids if since else 0
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": state.finish,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(state.output_ids),
        "cached_tokens": state.cached_tokens,
        "weight_version": state.weight_version,
        "e2e_latency": time.perf_counter() - state.created,
    }
    if req.return_logprob:
        text_of = token_text if req.return_text_in_logprobs else None
        meta["output_token_logprobs"] = logprob_entries(
            state.output_logprobs[first:], state.output_ids[first:], text_of
        )
        if req.top_logprobs_num > 0:
            meta["output_top_logprobs"] = top_entries(state.output_top[first:], text_of)
        if first == 0:
            start = max(req.logprob_start_len, 0)
            input_ids = req.input_ids[start:] if req.logprob_start_len >= 0 else []
            meta["input_token_logprobs"] = logprob_entries(state.input_logprobs, input_ids, text_of)
            if req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = top_entries(state.input_top, text_of)
    return {
        "text": state.text[since.text :] if since else state.text,
        "output_ids": state.output_ids[first:],
        "meta_info": meta,
    }
