"""What the engine sampled and what every API formats from it: `Generation` gathers the
engine's /generate replies (whole or streamed) token by token, `Completion` is the finished,
recorded turn, and the helpers build the parts all APIs share (the assistant message, OpenAI
log-probs, the finish reason). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clawrl.gateway.errors import EngineBadReply
from clawrl.gateway.tool_calls import ToolCall


@dataclass
class Generation:
    """What the engine sampled: kept whole, because it is what gets trained on."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str | None] = field(default_factory=list)
    top_logprobs: list[list] = field(default_factory=list)  # [[logprob, id, text], ...] per token
    finish: str | None = None  # "stop" | "length" once finished
    prompt_tokens: int = 0
    weight_version: str = ""  # the engine's, for the weights that sampled these tokens
    first_weight_version: str = ""  # the engine's on the first reply
    streamed: bool = False  # then first_weight_version is of the first tokens
    matched_stop: str | None = None  # the stop string that ended it (Anthropic reports it)

    def update(self, reply: dict[str, Any]) -> str:
        """Take one /generate reply or stream event; returns the text it adds. Handles both
        SGLang stream modes: cumulative events (the default) and incremental ones."""
        meta = reply.get("meta_info") or {}
        ids = reply.get("output_ids")
        entries = meta.get("output_token_logprobs")
        if ids is None or entries is None:
            raise EngineBadReply("the engine's reply has no output_ids or output_token_logprobs")
        completion_tokens = meta.get("completion_tokens")
        cumulative = completion_tokens is None or len(ids) == completion_tokens
        logprobs = [entry[0] for entry in entries]
        texts = [entry[2] if len(entry) > 2 else None for entry in entries]
        tops = meta.get("output_top_logprobs") or []
        text = reply.get("text") or ""
        if cumulative:
            added = text[len(self.text) :] if text.startswith(self.text) else ""
            self.ids, self.logprobs, self.token_texts, self.text = ids, logprobs, texts, text
            self.top_logprobs = list(tops)
        else:
            added = text
            self.ids += ids  # in place: copying per event made a long stream quadratic
            self.logprobs += logprobs
            self.token_texts += texts
            self.top_logprobs += tops
            self.text += text
        if len(self.logprobs) != len(self.ids):
            raise EngineBadReply(
                f"the engine returned {len(self.ids)} output ids but {len(self.logprobs)} log-probs"
            )
        self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
        if meta.get("weight_version") is not None:
            self.weight_version = str(meta["weight_version"])
            self.first_weight_version = self.first_weight_version or self.weight_version
        finish = meta.get("finish_reason")
        if finish:
            kind = finish.get("type") if isinstance(finish, dict) else str(finish)
            if kind not in ("stop", "length"):
                raise EngineBadReply(f"the engine ended the generation with {kind!r}")
            self.finish = kind
            matched = finish.get("matched") if isinstance(finish, dict) else None
            self.matched_stop = matched if isinstance(matched, str) else None
        return added


def trim_stop_string(generation: Generation, decode: Callable[[list[int]], str] | None) -> None:
    """Cut what an engine left of the stop string that ended a generation. SGLang trims the
    matched stop string only from text it has not sent on yet: the first characters of a stop
    string that spans tokens, sampled before it could match, stay in its streamed text (and in
    a whole reply when they fell on its force-stream interval), while the same tokens unstreamed
    give the text without them. The sampled ids decide: decoded, the stop string begins where
    the text should end, and a text that goes on past that by a proper prefix of it loses the
    prefix. Any other text is the engine's, left as it is (`decode`: the policy tokenizer's)."""
    matched, text = generation.matched_stop, generation.text
    if not matched or generation.finish != "stop" or decode is None:
        return
    if not any(text.endswith(matched[:n]) for n in range(1, len(matched))):
        return  # cheap: nothing that could be a leftover (the usual case)
    decoded = decode(generation.ids)
    at = decoded.find(matched)
    if at < 0:
        return
    cut = decoded[:at]
    if text != cut and text.startswith(cut) and matched.startswith(text[len(cut) :]):
        generation.text = cut


@dataclass
class HeldText:
    """What of a streamed generation's text can be sent yet: with stop strings, its last
    `hold` characters (the longest stop string's length less one) wait for the next event, as
    SGLang's own stream does not, so nothing sent can turn out to begin a stop string; once the
    generation ends, the rest (after trim_stop_string)."""

    hold: int = 0
    sent: int = 0

    @classmethod
    def for_stops(cls, stops: list[str] | None) -> HeldText:
        return cls(max((len(stop) for stop in stops or ()), default=1) - 1)

    def advance(self, text: str, finished: bool = False) -> str:
        end = len(text) if finished else len(text) - self.hold
        if end <= self.sent:
            return ""
        added, self.sent = text[self.sent : end], end
        return added


def assistant_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant message of a response, streamed or not (anonymous matching hashes it, so
    both paths must build it the same way): with tool calls, the text around them, stripped,
    or None."""
    if not calls:
        return {"role": "assistant", "content": content or ""}
    return {
        "role": "assistant",
        "content": (content or "").strip() or None,
        "tool_calls": [call.to_openai() for call in calls],
    }


def _token_logprob(token: str | None, logprob: float) -> dict[str, Any]:
    token = token or ""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def openai_logprobs(generation: Generation, start: int = 0) -> dict[str, Any]:
    """OpenAI `logprobs` of the sampled tokens from `start` on, with the engine's top
    alternatives when they were asked for (`top_logprobs`)."""
    content = []
    tops = generation.top_logprobs
    for i in range(start, len(generation.ids)):
        entry = _token_logprob(generation.token_texts[i], generation.logprobs[i])
        alternatives = tops[i] if i < len(tops) and tops[i] else []
        entry["top_logprobs"] = [
            _token_logprob(top[2] if len(top) > 2 else None, top[0]) for top in alternatives
        ]
        content.append(entry)
    return {"content": content}


@dataclass
class Completion:
    """A finished generation as every API formats it (recorded, when a main turn, before any
    of it is formatted)."""

    request_id: str  # also the response id the client gets
    generation: Generation
    content: str | None  # the text around the tool calls (None: only calls)
    calls: list[ToolCall]
    message: dict[str, Any]  # the assistant message, chat-completions shaped, as recorded
    finish: str  # chat-completions finish reason: stop | length | tool_calls
    prompt_tokens: int
    policy_version: int
    headers: dict[str, str] = field(default_factory=dict)  # X-Session-Id, X-Turn-Id

    @property
    def completion_tokens(self) -> int:
        return len(self.generation.ids)


def finish_reason(generation: Generation, calls: list[ToolCall]) -> str:
    """OpenAI finish reason of a finished generation."""
    return "tool_calls" if calls else (generation.finish or "stop")
