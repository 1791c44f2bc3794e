"""Incremental detokenisation: the text of a growing sequence of ids, decoding a short window
per new token instead of the whole output (the scheme of SGLang's and vLLM's detokenizers).

Byte-level BPE may split one character over several tokens; text whose last character is not
complete yet (a trailing U+FFFD) is held back until the bytes that finish it arrive.
"""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int], bool], str]

INCOMPLETE_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """`push` ids as they come; `text` is everything complete so far."""

    def __init__(self, decode: Decode, skip_special_tokens: bool = True):
        self._decode = decode
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids before this are in `text`
        self.text = ""

    def push(self, ids: list[int]) -> str:
        """Add ids; returns the text they complete (may be empty)."""
        self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The end of the sequence: whatever is held back, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read], self._skip)
        window = self._decode(self._ids[self._prefix :], self._skip)
        if not final and (len(window) <= len(before) or window.endswith(INCOMPLETE_CHAR)):
            return ""
        new = window[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += new
        return new
