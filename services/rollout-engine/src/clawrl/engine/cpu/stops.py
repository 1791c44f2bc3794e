"""When a sequence is finished (SGLang's finish reasons, see clawrl.engine.generation): pure
functions of the ids and text produced so far."""

from __future__ import annotations

from clawrl.engine.generation import FinishReason, StopCriteria, length_reason


def token_finish(criteria: StopCriteria, output_ids: list[int]) -> FinishReason | None:
    """Finish reason after the last token, judged on ids only. As in SGLang the length limit is
    checked first, then stop_token_ids, then eos (unless ignore_eos)."""
    if len(output_ids) >= criteria.max_new_tokens:
        return length_reason(criteria.max_new_tokens)
    if not output_ids:
        return None
    last = output_ids[-1]
    if last in criteria.stop_token_ids or (
        not criteria.ignore_eos and last in criteria.eos_token_ids
    ):
        return {"type": "stop", "matched": last}
    return None


def find_stop_string(text: str, stop_strings: tuple[str, ...]) -> tuple[str, int] | None:
    """The stop string that occurs first in `text` and where, or None."""
    best: tuple[str, int] | None = None
    for stop in stop_strings:
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[1]):
            best = (stop, at)
    return best
