"""One request inside the scheduler: its output so far, the text streamed of it (stop strings
held back until they cannot match), and its prefill state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from clawrl.engine.cpu.detokenizer import IncrementalDetokenizer
from clawrl.engine.cpu.stops import find_stop_string, token_finish
from clawrl.engine.generation import (
    FinishReason,
    GenerationRequest,
    GenerationUpdate,
    TopLogprobs,
)

Emit = Callable[[GenerationUpdate], None]
Decode = Callable[[list[int], bool], str]
# hidden [N, H], target ids, top-n -> each target's log-prob (and top-n alternatives).
LogprobsOf = Callable[[torch.Tensor, list[int], int], tuple[list[float], list[TopLogprobs | None]]]


class Sequence:
    """One request inside the scheduler. `aborted` may be set from any thread."""

    def __init__(
        self,
        request: GenerationRequest,
        emit: Emit,
        generator: torch.Generator | None,
        decode: Decode,
    ):
        self.request = request
        self.emit = emit
        self.generator = generator
        self.output_ids: list[int] = []
        self.aborted: str | None = None
        self.arrived = time.perf_counter()
        self.last_token_at: float | None = None
        self.detok = IncrementalDetokenizer(decode, request.skip_special_tokens)
        self.text_sent = 0  # characters of detok.text already emitted
        self.stop_scanned = 0  # characters of detok.text already searched for stop strings
        self.weight_version = ""
        self.cached_tokens: int | None = None  # set at the first prefill
        self.adapter = request.lora_id  # LoRA adapter key; None: the base model
        self.slot_wait_since: float | None = None  # when it first waited for an adapter slot
        # Prefill state: the tokens to put in the KV (the prompt, plus the output so far when
        # a retracted sequence comes back), how many are in already, and that KV.
        self.feed: list[int] = list(request.input_ids)
        self.fed = 0
        self.cache: Any = None  # DynamicCache or prefix-cache KV while prefilling
        self.prev_hidden: torch.Tensor | None = None  # [H] of the last fed token
        self.input_logprobs: list[float | None] = []
        self.input_top: list = []
        self.input_sent = False

    @property
    def wants_input_logprobs(self) -> bool:
        req = self.request
        return req.return_logprob and req.logprob_start_len >= 0 and not self.input_sent

    def retract(self) -> None:
        """Drop this sequence's KV; it will be prefilled again with its output so far."""
        self.feed = list(self.request.input_ids) + self.output_ids
        self.fed, self.cache, self.prev_hidden = 0, None, None

    def abort(self, reason: str) -> None:
        self.aborted = reason

    def first_update(self) -> dict:
        """Fields only the first update of a request carries."""
        if self.input_sent:
            return {}
        self.input_sent = True
        fields: dict[str, Any] = {"cached_tokens": self.cached_tokens}
        if self.request.return_logprob and self.request.logprob_start_len >= 0:
            fields.update(input_logprobs=self.input_logprobs, input_top=self.input_top)
        return fields

    def add_input_logprobs(self, hidden: torch.Tensor, logprobs_of: LogprobsOf) -> None:
        """Collect the prompt log-probs this chunk (hidden: [n, H], positions fed-n..fed-1 of
        the prompt, not yet counted in self.fed) makes computable."""
        req = self.request
        first = self.fed  # position of hidden[0]
        end = min(first + hidden.shape[0], len(req.input_ids))
        start = max(req.logprob_start_len, first)
        if start == 0:
            self.input_logprobs.append(None)  # the first token has no log-prob, as in SGLang
            self.input_top.append(None)
            start = 1
        if start >= end:
            return
        # Target p is predicted by the hidden state at p - 1 (the previous chunk's last one
        # when p is this chunk's first position).
        prev = self.prev_hidden
        states = hidden if prev is None else torch.cat([prev[None], hidden])
        offset = first if prev is None else first - 1
        logps, tops = logprobs_of(
            states[start - 1 - offset : end - 1 - offset],
            req.input_ids[start:end],
            req.top_logprobs_num,
        )
        self.input_logprobs.extend(logps)
        self.input_top.extend(tops)

    def append(self, token: int, logp: float | None, top: TopLogprobs | None) -> GenerationUpdate:
        """Take the next sampled token (with its log-prob and top alternatives when asked):
        the update that tells the request, finished when a stop token or string ends it."""
        self.output_ids.append(token)
        finish = token_finish(self.request.stop, self.output_ids)
        new_text, finish = self.new_text(token, finish)
        return GenerationUpdate(
            new_ids=[token],
            new_text=new_text,
            new_logprobs=[logp] if logp is not None else [],
            new_top=[top] if top is not None else [],
            finish=finish,
            weight_version=self.weight_version,
            **self.first_update(),
        )

    def new_text(self, token: int, finish: FinishReason | None) -> tuple[str, FinishReason | None]:
        """The text `token` adds, and the finish reason once a stop string shows up. A matched
        stop token is not text (unless no_stop_trim); while stop strings may still match, their
        possible beginnings are held back so streamed text never has to be taken back."""
        req = self.request
        matched_token = finish is not None and isinstance(finish.get("matched"), int)
        if not (matched_token and not req.no_stop_trim):
            self.detok.push([token])
        if finish is not None:
            self.detok.flush()
        text = self.detok.text
        end = len(text)
        stops = req.stop.stop_strings
        if stops and finish is None:
            longest = max(len(s) for s in stops)
            window = max(0, self.stop_scanned - longest + 1)
            found = find_stop_string(text[window:], stops)
            self.stop_scanned = len(text)
            if found is not None:
                matched, at = found
                finish = {"type": "stop", "matched": matched}
                if req.no_stop_trim:
                    self.detok.flush()
                    text, end = self.detok.text, len(self.detok.text)
                else:
                    end = window + at
            else:
                end = len(text) - (longest - 1)
        new = text[self.text_sent : end] if end > self.text_sent else ""
        self.text_sent = max(self.text_sent, end)
        return new, finish
