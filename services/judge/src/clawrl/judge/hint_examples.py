"""Two real hint plug-ins that need no judge model (see clawrl.judge.hint_fns for the signature):

- `next_message`: the user's next message itself is the hint ("Please, answer in one paragraph"
  is an instruction the reply could have been given up front). None when the next state has no
  user message (tool results only).
- `corrective_sentences`: only the sentences of the user's next message that correct the reply or
  ask for something (a keyword rule: "next time", "please", "instead", "too ...", "could you ...",
  ...), each as a candidate and all of them together as one more; None when the user only
  praised the reply or moved on. `drop_after` names a marker after which the message is a new
  request rather than feedback (`clawrl simulate`'s user writes "... Next: <question>").

Both read only what the user said next (the next state), never the reply, so the hint is what a
user actually asked for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from clawrl.judge.turns import TurnView

SENTENCE = re.compile(r"[^.!?]+[.!?]*")
# Words and phrases that mark a correction or a request (whole words, case ignored).
CORRECTIVE = (
    "next time", "please", "instead", "should", "shouldn't", "don't", "do not", "avoid",
    "without", "stop", "too", "no", "not", "could you", "can you", "would you", "why", "keep",
    "rather", "prefer", "less", "fewer", "wrong", "i asked", "i said", "i wanted",
)  # fmt: skip


def _cue_pattern(cues: Sequence[str]) -> re.Pattern[str]:
    return re.compile(r"\b(?:" + "|".join(re.escape(c) for c in cues) + r")\b", re.IGNORECASE)


def _feedback_text(turn: TurnView, drop_after: str | None) -> str:
    text = turn.next_user_text()
    if drop_after and drop_after in text:
        text = text[: text.index(drop_after)]
    return text.strip()


def next_message(turn: TurnView, *, drop_after: str | None = None) -> str | None:
    """The user's next message (up to `drop_after`) as the hint; None when there is none."""
    return _feedback_text(turn, drop_after) or None


def corrective_sentences(
    turn: TurnView, *, drop_after: str | None = None, cues: Sequence[str] = CORRECTIVE
) -> list[str] | None:
    """The corrective sentences of the user's next message: each one, then all of them together
    (one candidate when there is one); None when no sentence carries a cue."""
    text = _feedback_text(turn, drop_after)
    sentences = [s.strip() for s in SENTENCE.findall(text) if s.strip()]
    pattern = _cue_pattern(cues)
    picked = [s for s in sentences if pattern.search(s)]
    if not picked:
        return None
    return [*picked, " ".join(picked)] if len(picked) > 1 else picked
