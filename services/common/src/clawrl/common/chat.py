"""Chat-template rendering with the model's own tokenizer.

The gateway (and the CPU engine's /v1/chat/completions) turn OpenAI messages into prompt token
ids here, once per request; the ids go to the engine as `input_ids`, so what is trained on is
exactly what was served.

Control tokens (`<|im_end|>`, `<|im_start|>`, ...) written in messages or tools are encoded as
plain text by default: only the template itself writes turn boundaries, so a tool result or a
user message cannot forge them in the prompt (and in the recorded training data). Each control
token found in the caller's strings is wrapped in two noncharacters before rendering; the encoder
then tells it from the template's own tokens.
"""

from __future__ import annotations

import inspect
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

# Unicode noncharacters (never in text that is exchanged) around a control token that came from
# the caller's messages or tools.
MARK_START, MARK_END = "\ufdd0", "\ufdd1"


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


def mark_control_tokens(value: Any, controls: re.Pattern[str]) -> Any:
    """`value` (messages, tools: strings inside dicts and lists) with each control token in its
    strings wrapped in MARK_START/MARK_END. Markers already in a string are dropped first, so a
    caller cannot forge one around a token the template writes. Dict keys are left alone."""
    if isinstance(value, str):
        if MARK_START in value or MARK_END in value:
            value = value.replace(MARK_START, "").replace(MARK_END, "")
        return controls.sub(lambda match: MARK_START + match.group(0) + MARK_END, value)
    if isinstance(value, dict):
        return {key: mark_control_tokens(item, controls) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_control_tokens(item, controls) for item in value]
    return value


class SegmentEncoder:
    """Tokenises text piece by piece between added tokens (`<|im_start|>`, `<|im_end|>`, ...),
    remembering the ids of recent pieces. A fast tokenizer splits text at its added tokens
    before anything else, so the ids are those of encoding the whole text; a conversation's
    next prompt then only tokenises its new messages (its earlier ones, the system prompt and
    the tool schemas are pieces seen before). `encode_marked` also encodes the control tokens a
    caller wrote (marked by `mark_control_tokens`) as plain text. Thread-safe (renders also run
    in a worker)."""

    def __init__(self, backend: Any, max_pieces: int = 8192) -> None:
        tokens = backend.get_added_tokens_decoder()
        self._backend = backend
        self._special = {token.content: token_id for token_id, token in tokens.items()}
        pattern = "|".join(re.escape(t) for t in sorted(self._special, key=len, reverse=True))
        self._split = re.compile(f"({pattern})")
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._max_pieces = max_pieces
        self._lock = threading.Lock()
        # Control tokens: every added token but whitespace ones (a "\n" token is text anyway).
        controls = sorted((t for t in self._special if not t.isspace()), key=len, reverse=True)
        self.controls = re.compile("|".join(map(re.escape, controls)) or "(?!)")
        # A control token the caller wrote: marked on either side (a template that cut a marked
        # string may have cut one marker off; callers cannot write markers), or a lone marker.
        self._marked = re.compile(
            f"{MARK_START}({self.controls.pattern}){MARK_END}?"
            f"|({self.controls.pattern}){MARK_END}|[{MARK_START}{MARK_END}]"
        )
        self._as_text = {token: self._plain_text_ids(token) for token in controls}
        # Tokens whose plain-text ids are added tokens again: cannot be made text.
        added = set(self._special.values())
        self.unsanitizable = [t for t, ids in self._as_text.items() if added.intersection(ids)]

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

    def _plain_text_ids(self, text: str) -> list[int]:
        """`text` through the tokenizer's normaliser, pre-tokeniser and model, without matching
        added tokens: how a control token in a message is encoded."""
        backend = self._backend
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        words = [text]
        if backend.pre_tokenizer is not None:
            words = [word for word, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for word in words for token in backend.model.tokenize(word)]

    def encode_marked(self, text: str) -> list[int]:
        """Ids of a chat rendered from marked messages (`mark_control_tokens`): a marked
        control token as plain text, a lone marker dropped (the text on its two sides is
        encoded apart, so it cannot join into a control token), the rest as `encode` does."""
        if MARK_START not in text and MARK_END not in text:
            return self.encode(text)
        ids: list[int] = []
        done = 0
        for match in self._marked.finditer(text):
            ids.extend(self.encode(text[done : match.start()]))
            token = match.group(1) or match.group(2)
            if token:
                ids.extend(self._as_text[token])
            done = match.end()
        ids.extend(self.encode(text[done:]))
        return ids

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
    """Renders chat messages (+ tools) to prompt ids with one tokenizer and one template.
    `sanitize_control_tokens`: control tokens in the messages and tools are encoded as plain
    text (see the module's docstring); off, they become the control tokens they spell."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    template: str
    segments: SegmentEncoder | None = field(default=None, compare=False, repr=False)
    sanitize_control_tokens: bool = True

    def __post_init__(self) -> None:
        if self.sanitize_control_tokens and self.segments and self.segments.unsanitizable:
            raise ValueError(
                f"{self.segments.unsanitizable} encode to added tokens even as plain text: set "
                "model.sanitize_control_tokens = false to tokenise control tokens in messages "
                "as such"
            )
        # Without a SegmentEncoder, transformers does the sanitising (since its 5.x releases).
        if (
            self.sanitize_control_tokens
            and self.segments is None
            and "sanitize_control_tokens"
            not in inspect.signature(self.tokenizer.apply_chat_template).parameters
        ):
            raise ValueError(
                "this tokenizer's added tokens cannot be split out piecewise and this "
                "transformers cannot encode control tokens in messages as text: upgrade "
                "transformers, or set model.sanitize_control_tokens = false"
            )

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        template_path: Path | None = None,
        *,
        sanitize_control_tokens: bool = True,
    ) -> ChatRenderer:
        """Use `template_path` if given, else the tokenizer's template when it can render tools,
        else clawrl's ChatML + Hermes tool template (one template for every turn of a model)."""
        if template_path is not None:
            template = Path(template_path).read_text()
        elif tokenizer.chat_template and "tools" in tokenizer.chat_template:
            template = tokenizer.chat_template
        else:
            template = builtin_template()
        segments = SegmentEncoder.for_tokenizer(tokenizer)
        return cls(tokenizer, template, segments, sanitize_control_tokens)

    @classmethod
    def from_settings(cls, settings: ModelSettings) -> ChatRenderer:
        from transformers import AutoTokenizer  # heavy import, only where a renderer is built

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(settings)))
        return cls.for_tokenizer(
            tokenizer,
            settings.chat_template,
            sanitize_control_tokens=settings.sanitize_control_tokens,
        )

    def _apply(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        **options: Any,
    ) -> Any:
        try:
            return self.tokenizer.apply_chat_template(
                normalize_messages(messages),
                tools=tools or None,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                **options,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja errors: undefined keys, template exceptions
            raise ChatTemplateError(
                f"cannot render messages with the chat template: {exc}"
            ) from exc

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return self._apply(messages, tools, add_generation_prompt, tokenize=False)

    def render_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt token ids. The template already writes special tokens, so none are added."""
        if not self.sanitize_control_tokens:
            text = self.render_text(messages, tools, add_generation_prompt)
            if self.segments is not None:
                return self.segments.encode(text)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if self.segments is None:
            return list(
                self._apply(
                    messages,
                    tools,
                    add_generation_prompt,
                    tokenize=True,
                    return_dict=False,
                    sanitize_control_tokens=True,
                )
            )
        controls = self.segments.controls
        text = self.render_text(
            mark_control_tokens(messages, controls),
            mark_control_tokens(tools, controls),
            add_generation_prompt,
        )
        return self.segments.encode_marked(text)

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end an assistant turn (the tokenizer's eos, e.g. <|im_end|>)."""
        eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        return [int(i) for i in ids]
