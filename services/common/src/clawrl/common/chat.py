"""Chat-template rendering with the model's own tokenizer.

The gateway (and the CPU engine's /v1/chat/completions) turn OpenAI messages into prompt token
ids here, once per request; the ids go to the engine as `input_ids`, so what is trained on is
exactly what was served.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings

TOOLS_TEMPLATE = "chatml_tools.jinja"


class ChatTemplateError(ValueError):
    """Messages the template cannot render (bad structure or content)."""


def builtin_template(name: str = TOOLS_TEMPLATE) -> str:
    return resources.files("clawrl.common").joinpath("templates", name).read_text()


def content_text(content: Any) -> str:
    """OpenAI message content as plain text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"only text content parts are supported, got {kind!r}")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ChatTemplateError(f"message content must be a string or a list of parts, got {content!r}")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with text content, ready for a Jinja template."""
    return [{**message, "content": content_text(message.get("content"))} for message in messages]


@dataclass(frozen=True)
class ChatRenderer:
    """Renders chat messages (+ tools) to prompt ids with one tokenizer and one template."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    template: str

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, template_path: Path | None = None) -> ChatRenderer:
        """Use `template_path` if given, else the tokenizer's template when it can render tools,
        else clawrl's ChatML + Hermes tool template (one template for every turn of a model)."""
        if template_path is not None:
            template = Path(template_path).read_text()
        elif tokenizer.chat_template and "tools" in tokenizer.chat_template:
            template = tokenizer.chat_template
        else:
            template = builtin_template()
        return cls(tokenizer=tokenizer, template=template)

    @classmethod
    def from_settings(cls, settings: ModelSettings) -> ChatRenderer:
        from transformers import AutoTokenizer  # heavy import, only where a renderer is built

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(settings)))
        return cls.for_tokenizer(tokenizer, settings.chat_template)

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                normalize_messages(messages),
                tools=tools or None,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja errors: undefined keys, template exceptions
            raise ChatTemplateError(
                f"cannot render messages with the chat template: {exc}"
            ) from exc

    def render_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt token ids. The template already writes special tokens, so none are added."""
        text = self.render_text(messages, tools, add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end an assistant turn (the tokenizer's eos, e.g. <|im_end|>)."""
        eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        return [int(i) for i in ids]
