"""SGLang's /generate reply built from a GenerationState.

Streaming follows SGLang's default (`--incremental-streaming-output` off): every event carries
the *cumulative* `text`, `output_ids` and `meta_info.output_token_logprobs` so far, and the last
event has a non-null `finish_reason`. A client only needs the last event it has seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from clawrl.engine.generation import GenerationState, TopLogprobs

Decode = Callable[[list[int], bool], str]

# A trailing replacement character is a multi-byte character whose bytes are not all out
# yet; intermediate stream events hold it back, as SGLang's incremental detokenizer does.
INCOMPLETE_CHAR = "\ufffd"


def output_text(state: GenerationState, decode: Decode) -> str:
    """The generated text: cut before a matched stop string, and without a matched stop token
    (SGLang trims both unless no_stop_trim)."""
    req = state.request
    if state.stop_text is not None:
        return state.stop_text
    ids = state.output_ids
    finish = state.finish or {}
    if (
        finish.get("type") == "stop"
        and isinstance(finish.get("matched"), int)
        and ids
        and not req.no_stop_trim
    ):
        ids = ids[:-1]
    text = decode(ids, req.skip_special_tokens)
    if not state.finished:
        text = text.rstrip(INCOMPLETE_CHAR)
    return text


def logprob_entries(
    logps: list[float | None], ids: list[int], decode: Decode | None
) -> list[list[Any]]:
    """SGLang's `[[logprob, token_id, text|None], ...]`."""
    return [
        [lp, tid, decode([tid], False) if decode else None]
        for lp, tid in zip(logps, ids, strict=True)
    ]


def top_entries(tops: list[TopLogprobs | None], decode: Decode | None) -> list[Any]:
    return [
        None
        if top is None
        else [[lp, tid, decode([tid], False) if decode else None] for lp, tid in top]
        for top in tops
    ]


def generate_response(state: GenerationState, decode: Decode, weight_version: str) -> dict:
    """`{text, output_ids, meta_info}` as SGLang's /generate returns it."""
    req = state.request
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": state.finish,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(state.output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "e2e_latency": time.perf_counter() - state.created,
    }
    if req.return_logprob:
        text_of = decode if req.return_text_in_logprobs else None
        start = max(req.logprob_start_len, 0)
        input_ids = req.input_ids[start:] if req.logprob_start_len >= 0 else []
        meta["input_token_logprobs"] = logprob_entries(state.input_logprobs, input_ids, text_of)
        meta["output_token_logprobs"] = logprob_entries(
            state.output_logprobs, state.output_ids, text_of
        )
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = top_entries(state.input_top, text_of)
            meta["output_top_logprobs"] = top_entries(state.output_top, text_of)
    return {
        "text": output_text(state, decode),
        "output_ids": list(state.output_ids),
        "meta_info": meta,
    }
