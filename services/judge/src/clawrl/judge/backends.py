"""Where the votes go: the judge engine's SGLang API (`/generate` with the judge model's chat
template rendered here), or any OpenAI-compatible chat API (the official `openai` client), e.g. a
hosted model while training locally.

Failures are the engine client's two types, whichever backend: `EngineUnavailable` (down, timed
out, 5xx, rate-limited: the turn waits and retries) and `EngineRequestError` (this request was
rejected: the vote fails and is dropped)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import openai

from clawrl.common.chat import ChatRenderer
from clawrl.common.sglang_client import (
    EngineRequestError,
    EngineUnavailable,
    SGLangClient,
    sampling_params,
)


class PromptTooLong(ValueError):
    """The judge prompt does not fit the judge model's context; shorten it and retry."""


@dataclass(frozen=True)
class Prepared:
    """A judge prompt in the form its backend sends (ids or messages), built once per turn."""

    messages: list[dict[str, str]]
    input_ids: list[int] | None = None


class VoteBackend(Protocol):
    def prepare(self, messages: list[dict[str, str]]) -> Prepared: ...

    async def vote(self, prompt: Prepared) -> str: ...

    async def aclose(self) -> None: ...


class SGLangVotes:
    """Votes from an SGLang-API engine: the prompt is rendered with the judge model's template
    and sent as input_ids (checked against the context window first)."""

    def __init__(
        self,
        engine: SGLangClient,
        renderer: ChatRenderer,
        *,
        context_tokens: int,
        temperature: float,
        max_new_tokens: int,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.context_tokens = context_tokens
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens

    def prepare(self, messages: list[dict[str, str]]) -> Prepared:
        ids = self.renderer.render_ids(messages)
        if len(ids) + self.max_new_tokens > self.context_tokens:
            raise PromptTooLong(
                f"judge prompt of {len(ids)} tokens + {self.max_new_tokens} new tokens exceeds "
                f"the judge context of {self.context_tokens}"
            )
        return Prepared(messages=messages, input_ids=ids)

    async def vote(self, prompt: Prepared) -> str:
        reply = await self.engine.generate(
            {
                "input_ids": prompt.input_ids,
                "sampling_params": sampling_params(
                    max_new_tokens=self.max_new_tokens, temperature=self.temperature
                ),
            }
        )
        return str(reply.get("text") or "")

    async def aclose(self) -> None:
        pass  # the engine client is shared with the teacher; the service closes it


class OpenAIVotes:
    """Votes from an OpenAI-compatible chat API. Retries are ours (the turn's backoff), not the
    client's, so max_retries is 0."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str,
        temperature: float,
        max_new_tokens: int,
        timeout_s: float,
    ) -> None:
        self.client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0
        )
        self.model = model
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens

    def prepare(self, messages: list[dict[str, str]]) -> Prepared:
        return Prepared(messages=messages)

    async def vote(self, prompt: Prepared) -> str:
        try:
            completion = await self.client.chat.completions.create(
                model=self.model,
                messages=prompt.messages,  # type: ignore[arg-type]
                temperature=self.temperature,
                max_tokens=self.max_new_tokens,
            )
        except (openai.APIConnectionError, openai.RateLimitError) as exc:
            raise EngineUnavailable(f"judge API unavailable: {exc}") from exc
        except openai.APIStatusError as exc:
            if exc.status_code >= 500:
                raise EngineUnavailable(
                    f"judge API answered {exc.status_code}: {exc.message}", exc.status_code
                ) from exc
            raise EngineRequestError(exc.message, exc.status_code) from exc
        if not completion.choices:
            raise EngineRequestError("judge API returned no choices")
        return completion.choices[0].message.content or ""

    async def aclose(self) -> None:
        await self.client.close()
