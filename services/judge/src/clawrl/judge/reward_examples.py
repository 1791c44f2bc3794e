"""Four real reward plug-ins (see clawrl.judge.rewards for the signature):

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
- `remark_sentiment`: the same idea for a user who words things freely (`clawrl simulate
  --remarks varied`: "Perfect.", "Could you keep it to one paragraph?", "Too short."): +1 / -1 /
  None from a small lexicon of approval and correction cues (requests in question form
  included) in the opening of the next message. A keyword rule, not a model: the lexicon was
  written beside the simulator's remarks and is tested on every one of them; how well it reads
  real users is not measured.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from clawrl.judge.turns import TurnView

WORD = re.compile(r"[^\W_]+", re.UNICODE)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# Cues that the user corrects the reply. Within a sentence they win over approval ("Thanks,
# but..."; a contrast after praise is a correction). A request in question form needs a
# corrective verb, so a new question ("Can you explain X?") is no complaint.
CORRECTION_CUES = re.compile(
    r"^(?:no|nope|hmm+|ugh|meh|wrong)\b|\b(?:but|however|not|never|without|please|instead"
    r"|rather|next time|wrong|barely|stop|enough with|hard to|wall of text|over and over"
    r"|same thing|circles|loops?|repeat\w*|do better|would be better|would help|would do"
    r"|are you sure)\b|n't\b"
    r"|\btoo \w+|\bwhy (?:the|all|so|one|did you|do you|are you|is it)\b|\bwould you mind\b"
    r"|\b(?:could|can|would|will) you (?:please )?(?:\w+ )?(?:keep|make|put|write|break|split"
    r"|use|stop|try|say|give|expand|shorten|answer|list|format|turn|avoid|drop|cut|fix|redo"
    r"|rewrite|check)\b",
    re.IGNORECASE,
)
APPROVAL_CUES = re.compile(
    r"^(?:yes|yep|yup|right|correct)\b|\b(?:thanks|thank you|perfect|great|nice|good|love"
    r"|exactly|excellent|lovely|wonderful|spot on|just right|just how|well done|much better"
    r"|helpful|awesome|brilliant|that's right|is right|correct)\b",
    re.IGNORECASE,
)
CONTRAST = re.compile(r"^(?:but|however|though|still)\b", re.IGNORECASE)
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


def remark_sentiment(turn: TurnView) -> float | None:
    """+1 / -1 from the first sentence of the user's next message that holds an approval or a
    correction cue (a correction wins within it; a following sentence that opens with "but" or
    "however" is read with it), so the user's remark decides and the new request after it
    does not; None when no sentence holds a cue or there is no next message. A keyword rule:
    see the module's docstring for what it has been checked on."""
    sentences = [s.strip() for s in SENTENCE_END.split(turn.next_user_text()) if s.strip()]
    for index, sentence in enumerate(sentences):
        following = sentences[index + 1] if index + 1 < len(sentences) else ""
        if CONTRAST.match(following):
            sentence = f"{sentence} {following}"
        if CORRECTION_CUES.search(sentence):
            return -1.0
        if APPROVAL_CUES.search(sentence):
            return 1.0
    return None
