"""Chat-template rendering with the model's own tokenizer.

The gateway (and the CPU engine's /v1/chat/completions) turn OpenAI messages into prompt token
ids here, once per request; the ids go to the engine as `input_ids`, so what is trained on is
exactly what was served.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
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


class SegmentEncoder:
    """Tokenises text piece by piece between added tokens (`<|im_start|>`, `<|im_end|>`, ...),
    remembering the ids of recent pieces. A fast tokenizer splits text at its added tokens
    before anything else, so the ids are those of encoding the whole text; a conversation's
    next prompt then only tokenises its new messages (its earlier ones, the system prompt and
    the tool schemas are pieces seen before). Thread-safe (renders also run in a worker)."""

    def __init__(self, backend: Any, max_pieces: int = 8192) -> None:
        tokens = backend.get_added_tokens_decoder()
        self._backend = backend
        self._special = {token.content: token_id for token_id, token in tokens.items()}
        pattern = "|".join(re.escape(t) for t in sorted(self._special, key=len, reverse=True))
        self._split = re.compile(f"({pattern})")
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._max_pieces = max_pieces
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> SegmentEncoder | None:
        """An encoder when piecewise encoding is exact for this tokenizer, else None: every
        added token must match verbatim (no normalisation, no stripping of neighbours)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        tokens = backend.get_added_tokens_decoder().values()
        if not tokens or any(
            t.normalized or t.lstrip or t.rstrip or t.single_word or not t.content for t in tokens
        ):
            return None
        return cls(backend)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._special.get(piece)
            if special is not None:
                ids.append(special)
                continue
            with self._lock:
                known = self._pieces.get(piece)
                if known is not None:
                    self._pieces.move_to_end(piece)
            if known is None:
                known = self._backend.encode(piece, add_special_tokens=False).ids
                with self._lock:
                    self._pieces[piece] = known
                    if len(self._pieces) > self._max_pieces:
                        self._pieces.popitem(last=False)
            ids.extend(known)
        return ids


@dataclass(frozen=True)
class ChatRenderer:
    """Renders chat messages (+ tools) to prompt ids with one tokenizer and one template."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    template: str
    segments: SegmentEncoder | None = field(default=None, compare=False, repr=False)

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
        return cls(tokenizer, template, SegmentEncoder.for_tokenizer(tokenizer))

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
        if self.segments is not None:
            return self.segments.encode(text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end an assistant turn (the tokenizer's eos, e.g. <|im_end|>)."""
        eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        return [int(i) for i in ids]
