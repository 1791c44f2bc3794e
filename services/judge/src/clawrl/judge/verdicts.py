"""The PRM verdict from log-probs (judging.prm = logprob): the judge engine reads the yes/no PRM
prompt once (`max_new_tokens` 1, temperature 0, the first answer token's top log-probs), and the
verdict is the share of probability on the yes-like tokens against the no-like ones. One forward
pass, nothing sampled, nothing to parse.

The pure parts (which ids are yes/no, the verdict from log-probs) are functions; `LogprobPRM`
only adds the engine call."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from clawrl.common.sglang_client import EngineRequestError, SGLangClient, sampling_params

log = logging.getLogger(__name__)

YES_WORDS = frozenset({"yes"})
NO_WORDS = frozenset({"no"})


class Tokenizer(Protocol):
    def __len__(self) -> int: ...

    def batch_decode(self, sequences: list[list[int]]) -> list[str]: ...


@dataclass(frozen=True)
class YesNoIds:
    """The judge tokenizer's ids of the tokens that answer yes, and those that answer no."""

    yes: frozenset[int]
    no: frozenset[int]


def yes_no_ids(pieces: Sequence[str]) -> YesNoIds:
    """The ids whose text (`pieces[id]`, the id decoded alone) is a yes or a no word in any case,
    with or without surrounding whitespace (" Yes", "no", "NO"). ValueError when either side has
    no token: such a tokenizer cannot give a one-token answer."""
    yes = frozenset(i for i, piece in enumerate(pieces) if piece.strip().lower() in YES_WORDS)
    no = frozenset(i for i, piece in enumerate(pieces) if piece.strip().lower() in NO_WORDS)
    if not yes or not no:
        raise ValueError(
            f"the judge tokenizer has no single token for {'yes' if not yes else 'no'}: "
            "judging.prm=logprob cannot read its answer"
        )
    return YesNoIds(yes, no)


def tokenizer_yes_no_ids(tokenizer: Tokenizer) -> YesNoIds:
    """`yes_no_ids` over every id of a Hugging Face tokenizer (~0.2 s for 49k ids)."""
    return yes_no_ids(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))


@dataclass(frozen=True)
class LogprobVerdict:
    """score: +1, -1, 0 (the yes share within the margin of 0.5); None when neither a yes nor a
    no token was among the top log-probs, or the engine rejected the request (`error`)."""

    score: int | None
    p_yes: float
    p_no: float
    error: str | None = None

    @property
    def yes_share(self) -> float | None:
        total = self.p_yes + self.p_no
        return self.p_yes / total if total > 0 else None

    @property
    def outcome(self) -> str:
        """The clawrl_judge_votes_total result: valid, invalid or failed."""
        return "failed" if self.error else "invalid" if self.score is None else "valid"

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"score": self.score, "p_yes": self.p_yes, "p_no": self.p_no}
        out["yes_share"] = self.yes_share
        if self.error:
            out["error"] = self.error
        return out


def verdict_from_top(top: Sequence[Sequence[Any]], ids: YesNoIds, margin: float) -> LogprobVerdict:
    """The verdict from one position's top log-probs, entries `[logprob, token_id, ...]` as
    SGLang returns them: p_yes and p_no sum exp(logprob) over the yes and no ids among them;
    +1 when p_yes / (p_yes + p_no) > 0.5 + margin, -1 when < 0.5 - margin, else 0."""
    p_yes = p_no = 0.0
    for entry in top:
        logprob, token_id = entry[0], int(entry[1])
        if logprob is None:
            continue
        if token_id in ids.yes:
            p_yes += math.exp(logprob)
        elif token_id in ids.no:
            p_no += math.exp(logprob)
    verdict = LogprobVerdict(None, p_yes, p_no)
    share = verdict.yes_share
    if share is None:
        return verdict
    score = 1 if share > 0.5 + margin else -1 if share < 0.5 - margin else 0
    return LogprobVerdict(score, p_yes, p_no)


def logprob_request(input_ids: Sequence[int], top_k: int) -> dict[str, Any]:
    """The /generate payload that reads the first answer token's top-k log-probs (greedy, one
    token)."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": sampling_params(max_new_tokens=1, temperature=0.0),
        "return_logprob": True,
        "top_logprobs_num": top_k,
    }


def first_token_top(meta: dict[str, Any]) -> list[Any]:
    """The first output token's top log-probs in /generate's `meta_info`; EngineRequestError
    when the engine gave none (an engine that ignores `top_logprobs_num`)."""
    tops = meta.get("output_top_logprobs") or []
    if not tops or not tops[0]:
        raise EngineRequestError("the engine returned no top log-probs for the first token")
    return list(tops[0])


class LogprobPRM:
    """The yes/no verdict of the judge engine on a prompt rendered by the vote backend."""

    def __init__(
        self, engine: SGLangClient, ids: YesNoIds, *, top_k: int = 20, margin: float = 0.2
    ) -> None:
        if not 0 <= margin < 0.5:
            raise ValueError(f"margin must be in [0, 0.5), got {margin}")
        self.engine = engine
        self.ids = ids
        self.top_k = top_k
        self.margin = margin

    async def verdict(self, input_ids: Sequence[int]) -> LogprobVerdict:
        """EngineUnavailable propagates (the turn waits); a rejected request is a failed
        verdict (score None, logged)."""
        try:
            reply = await self.engine.generate(logprob_request(input_ids, self.top_k))
            top = first_token_top(reply.get("meta_info") or {})
        except EngineRequestError as exc:
            log.warning("logprob PRM request failed: %s", exc.message)
            return LogprobVerdict(None, 0.0, 0.0, error=exc.message)
        return verdict_from_top(top, self.ids, self.margin)
