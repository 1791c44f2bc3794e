"""opd and combine send the judge engine the POLICY's token ids (hinted prompt + recorded
response) and keep its log-prob of each response id: that is only a teacher signal if the judge
model reads every id as the policy's tokenizer does. A judge model with another tokenizer scores
other tokens, and nothing downstream can tell (the engine echoes the ids it was sent). So the
judge refuses to start unless the engine it will score with agrees with the policy's tokenizer.

The check asks the engine itself, not a configured path: it sends token ids and reads back the
text the engine's tokenizer gives each one (`return_text_in_logprobs`, as SGLang's
`batch_decode` of single ids), then compares with the policy tokenizer's text of the same ids.
Probed: every added/special token of the policy (the chat template's turn markers among them)
and PROBE_SPREAD ids evenly spread over the vocabulary, its last id included (an engine with a
smaller vocabulary refuses it). Every id would take a minute of prefill on a CPU engine; a
different tokenizer family differs on nearly every id, so the spread finds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from clawrl.common.sglang_client import (
    EngineRequestError,
    EngineUnavailable,
    SGLangClient,
    sampling_params,
)

log = logging.getLogger(__name__)

PROBE_SPREAD = 1024
PROBE_CHUNK = 256  # ids per request: the engine computes [chunk, vocab] logits for them
SHOWN = 5  # mismatching ids named in the error


class Tokenizer(Protocol):
    added_tokens_decoder: dict[int, Any]

    def __len__(self) -> int: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class TokenizerMismatch(RuntimeError):
    """The judge engine reads the policy's token ids as other tokens."""


def probe_ids(tokenizer: Tokenizer, spread: int = PROBE_SPREAD) -> list[int]:
    """Sorted ids to compare: the added tokens and `spread` ids evenly spaced over
    [0, len(tokenizer)), both ends included."""
    size = len(tokenizer)
    count = min(spread, size)
    even = {round(i * (size - 1) / max(count - 1, 1)) for i in range(count)}
    return sorted(even | {i for i in tokenizer.added_tokens_decoder if 0 <= i < size})


def probe_request(ids: Sequence[int]) -> dict[str, Any]:
    """A /generate payload that only reads `ids` back with each one's text (no generation)."""
    return {
        "input_ids": list(ids),
        "sampling_params": sampling_params(max_new_tokens=0, temperature=0.0),
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }


def differences(
    tokenizer: Tokenizer, ids: Sequence[int], entries: Sequence[Sequence[Any]]
) -> list[tuple[int, str, str | None]]:
    """(id, policy text, engine text) for each probed id the engine's `input_token_logprobs`
    entries ([logprob, id, text]) do not give the policy's text for."""
    if len(entries) != len(ids):
        raise TokenizerMismatch(
            f"the judge engine returned {len(entries)} token entries for {len(ids)} probed ids"
        )
    found = []
    for sent, entry in zip(ids, entries, strict=True):
        mine = tokenizer.decode([sent], skip_special_tokens=False)
        theirs = entry[2] if len(entry) > 2 else None
        if int(entry[1]) != sent or theirs != mine:
            found.append((sent, mine, theirs))
    return found


def mismatch_message(url: str, mode: str, probed: int, found: list[tuple[int, str, str | None]]):
    shown = ", ".join(f"id {i}: policy {mine!r}, engine {theirs!r}" for i, mine, theirs in found)
    return (
        f"judging.mode={mode} scores the policy's token ids with the judge engine at {url}, but "
        f"its tokenizer differs from the policy's: {len(found)} of {probed} probed ids read as "
        f"other tokens ({shown[: SHOWN * 80]}). Its teacher log-probs would be of other tokens: "
        "serve a judge model with the policy's tokenizer (same vocabulary and special tokens)."
    )


async def check_tokenizer(engine: SGLangClient, tokenizer: Tokenizer, mode: str) -> int:
    """Raise TokenizerMismatch unless the engine reads the probed ids as `tokenizer` does;
    -> how many ids were probed. Engine errors other than a refusal propagate."""
    ids = probe_ids(tokenizer)
    found: list[tuple[int, str, str | None]] = []
    for start in range(0, len(ids), PROBE_CHUNK):
        chunk = ids[start : start + PROBE_CHUNK]
        try:
            reply = await engine.generate(probe_request(chunk))
        except EngineRequestError as exc:  # e.g. an id past a smaller vocabulary
            raise TokenizerMismatch(
                f"judging.mode={mode}: the judge engine at {engine.base_url} refused the "
                f"policy's token ids {chunk[0]}..{chunk[-1]} ({exc}): its tokenizer is not the "
                "policy's; serve a judge model with the policy's tokenizer."
            ) from exc
        entries = (reply.get("meta_info") or {}).get("input_token_logprobs") or []
        found += differences(tokenizer, chunk, entries)
    if found:
        raise TokenizerMismatch(mismatch_message(engine.base_url, mode, len(ids), found))
    return len(ids)


async def wait_and_check_tokenizer(
    engine: SGLangClient,
    tokenizer: Tokenizer,
    mode: str,
    retry_initial_s: float,
    retry_max_s: float,
) -> None:
    """`check_tokenizer`, waiting (with backoff) for an engine that is not up yet."""
    delay = retry_initial_s
    while True:
        try:
            probed = await check_tokenizer(engine, tokenizer, mode)
        except EngineUnavailable as exc:
            log.warning("judge engine %s not available for the tokenizer check (%s); retrying "
                        "in %.1fs", engine.base_url, exc, delay)  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(delay * 2, retry_max_s)
            continue
        log.info("judge engine %s reads the policy's token ids as the policy does (%d probed)",
                 engine.base_url, probed)  # fmt: skip
        return
