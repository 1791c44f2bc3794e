"""Hint plug-ins: a user function that writes the hindsight hint of a turn without asking a judge
model, named `module:function` in `judging.hint_fn` (with `judging.hint_fn_args`).

The function's signature::

    def hint(turn: clawrl.judge.turns.TurnView, **hint_fn_args) -> str | list[str] | None
    async def hint(turn: TurnView, **hint_fn_args) -> ...   # also accepted

It is called for turns with a next state (a hint is read from what came next), after an explicit
feedback's comment and before the judge's hint votes (see core.py). Return the hint, several
candidate hints (the judge keeps up to `judging.hint_candidates` and selects one), or None / ""
for "no hint here" (the judge's hint votes are then asked, when `judging.hint_votes` is on).

Unlike a reward plug-in, a hint plug-in that raises or returns something that is not text does not
fail the turn: the turn's sample is published masked (MASK_REASON_HINT_FN_FAILED) with the error
in its audit record and counted (`clawrl_judge_hint_fn_errors_total`), so a buggy plug-in costs
its turns' training signal, never the turns. Examples ship in `clawrl.judge.hint_examples`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawrl.judge.rewards import import_function
from clawrl.judge.turns import TurnView


class HintFnFailed(RuntimeError):
    """The hint plug-in raised, or returned something that is not a hint."""


@dataclass(frozen=True)
class HintFn:
    """A loaded hint plug-in with its fixed keyword arguments."""

    spec: str
    function: Callable[..., Any]
    kwargs: dict[str, Any]

    @property
    def source(self) -> str:
        """Sample.hint_source of the hints it gives."""
        return f"hint_fn:{self.spec}"

    async def __call__(self, turn: TurnView) -> list[str]:
        """The plug-in's hints as a list ([] for none); HintFnFailed for anything else."""
        try:
            result = self.function(turn, **self.kwargs)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            raise HintFnFailed(f"hint_fn {self.spec} raised {type(exc).__name__}: {exc}") from exc
        return check_hints(result, self.spec)


def check_hints(value: Any, spec: str) -> list[str]:
    """A str, a list of str, or None as a list of hints; HintFnFailed for anything else."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
    raise HintFnFailed(f"hint_fn {spec} returned {value!r}; expected a str, a list of str or None")


def load_hint_fn(spec: str, kwargs: dict[str, Any] | None = None) -> HintFn:
    """Import `module:function`; RewardFnError with a clear message when that fails."""
    return HintFn(spec=spec, function=import_function(spec, "hint_fn"), kwargs=dict(kwargs or {}))
