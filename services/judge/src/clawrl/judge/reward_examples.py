"""Three real reward plug-ins (see clawrl.judge.rewards for the signature):

- `ends_with_word`: +1 when the reply's last word is `word`, else -1 (a preference the policy
  can learn from scratch: `reward_fn = "clawrl.judge.reward_examples:ends_with_word"`,
  `reward_fn_args = {word = "banana"}`).
- `arithmetic_confirmed`: the user asked a sum and then says the right number; +1 when the last
  number of the reply is that number, -1 when it is another, None when the user's next message
  confirms no number (or the reply has none).
- `stated_preference`: the user says in their next message whether the reply suited them
  (`clawrl simulate`'s user: "Thanks, one short paragraph is just how I like it. Next: ..." or
  "Please, answer in one paragraph next time, ..."); +1 when the message opens with thanks, -1
  when it opens with a complaint, None otherwise. The reward comes from what the user said (the
  next state), never from the reply.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from clawrl.judge.turns import TurnView

WORD = re.compile(r"[^\W_]+", re.UNICODE)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def ends_with_word(turn: TurnView, *, word: str) -> float:
    """+1 when the reply's last word equals `word` (case-insensitive, punctuation ignored)."""
    words = WORD.findall(turn.response_text)
    return 1.0 if words and words[-1].casefold() == word.casefold() else -1.0


def arithmetic_confirmed(turn: TurnView) -> float | None:
    """+1 / -1 as the reply's last number matches the first number of the user's next message;
    None when either has no number."""
    confirmed = NUMBER.findall(turn.next_user_text())
    answered = NUMBER.findall(turn.response_text)
    if not confirmed or not answered:
        return None
    return 1.0 if float(answered[-1]) == float(confirmed[0]) else -1.0


def stated_preference(
    turn: TurnView,
    *,
    pleased: Sequence[str] = ("thanks", "thank you"),
    displeased: Sequence[str] = ("please",),
) -> float | None:
    """+1 / -1 as the user's next message opens with one of `pleased` / `displeased`
    (case-insensitive); None when it opens with neither or there is no next message."""
    said = turn.next_user_text().lstrip().casefold()
    if any(said.startswith(p.casefold()) for p in pleased):
        return 1.0
    if any(said.startswith(p.casefold()) for p in displeased):
        return -1.0
    return None
