"""What one generation is, between the HTTP layer and the scheduler thread: the validated
request, the updates the scheduler sends after each step, and the state they add up to."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

TopLogprobs = list[tuple[float, int]]

# Below this temperature a request is greedy (SGLang uses the same cut-off).
GREEDY_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingRow:
    """One sequence's sampling knobs (top_k <= 0 disables top-k)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def needs_filter(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


# SGLang's finish reasons: `{"type": "length", "length": N}`,
# `{"type": "stop", "matched": token_id | "stop string"}`, `{"type": "abort", "message": ...}`.
FinishReason = dict[str, Any]


@dataclass(frozen=True)
class StopCriteria:
    """What ends one sequence."""

    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()


def length_reason(length: int) -> FinishReason:
    return {"type": "length", "length": length}


def abort_reason(message: str) -> FinishReason:
    return {"type": "abort", "message": message}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated /generate (or chat) request, in token ids.

    logprob_start_len: first prompt position whose log-prob is returned; -1 returns none
    (SGLang's default: output log-probs only). lora_path: the adapter's name as the client gave
    it (SGLang's field); lora_id: the loaded adapter it resolved to (None: the base model).
    """

    input_ids: list[int]
    sampling: SamplingRow
    stop: StopCriteria
    seed: int | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    lora_path: str | None = None
    lora_id: str | None = None

    @property
    def max_new_tokens(self) -> int:
        return self.stop.max_new_tokens


@dataclass(frozen=True)
class GenerationUpdate:
    """One step's news for one sequence, sent from the scheduler thread.

    new_text is the text the new ids complete (stop strings cut, text that may still turn
    into a stop string held back); new_logprobs/new_top are empty unless the request asked
    for log-probs; input_* come once, with the first update; weight_version is the version of
    the weights that produced the tokens; cached_tokens the prompt tokens the prefix cache gave.
    """

    new_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[float] = field(default_factory=list)
    new_top: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None
    finish: FinishReason | None = None
    weight_version: str | None = None
    cached_tokens: int | None = None


@dataclass
class GenerationState:
    """Everything known about one request so far (lives on the asyncio side)."""

    request: GenerationRequest
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopLogprobs | None] = field(default_factory=list)
    finish: FinishReason | None = None
    weight_version: str = ""
    cached_tokens: int = 0
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def apply(self, update: GenerationUpdate) -> None:
        if update.new_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_ids.extend(update.new_ids)
        self.text += update.new_text
        self.output_logprobs.extend(update.new_logprobs)
        self.output_top.extend(update.new_top)
        if update.input_logprobs is not None:
            self.input_logprobs = update.input_logprobs
            self.input_top = update.input_top or []
        if update.weight_version is not None:
            self.weight_version = update.weight_version
        if update.cached_tokens is not None:
            self.cached_tokens = update.cached_tokens
        if update.finish is not None:
            self.finish = update.finish

    @property
    def finished(self) -> bool:
        return self.finish is not None
