"""Reward plug-ins: a user function that returns a reward for a turn (verifiable rewards: tests
passed, answer matched), named `module:function` in `judging.reward_fn`.

The function's signature::

    def reward(turn: clawrl.judge.turns.TurnView, **reward_fn_args) -> float | None
    async def reward(turn: TurnView, **reward_fn_args) -> float | None   # also accepted

`turn` gives the recorded turn (`turn.turn`, the Turn proto: ids, session_id, ...), and decoded
on first use: `turn.messages` (the request's OpenAI messages), `turn.tools`,
`turn.response_text`, `turn.response_message` (content and tool_calls), `turn.next_state` (every
message after the reply, [] when the turn was finalised without one), `turn.last_user_text()`,
`turn.next_user_text()`. `reward_fn_args` is the `judging.reward_fn_args` table. It is called for
every well-formed turn, with or without a next state.

Return a finite number (the reward; in rl, nonzero trains and 0 is neutral, i.e. masked unless
promoted), or None for "cannot tell" (neutral). An exception fails the turn: it is retried on
redelivery and dead-lettered with the error after `workers.max_deliveries`. A sync function runs
on the worker's event loop, so a slow one should be async (or hand its work to a thread).

Two real examples ship in `clawrl.judge.reward_examples`.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawrl.judge.turns import TurnView


class RewardFnError(RuntimeError):
    """The reward plug-in cannot be loaded, or returned something that is not a reward."""


@dataclass(frozen=True)
class RewardFn:
    """A loaded plug-in with its fixed keyword arguments."""

    spec: str
    function: Callable[..., Any]
    kwargs: dict[str, Any]

    @property
    def source(self) -> str:
        """Sample.reward_source of the rewards it gives."""
        return f"reward_fn:{self.spec}"

    async def __call__(self, turn: TurnView) -> float | None:
        result = self.function(turn, **self.kwargs)
        if inspect.isawaitable(result):
            result = await result
        return check_reward(result, self.spec)


def check_reward(value: Any, spec: str) -> float | None:
    """The reward as a float, None for "cannot tell"; RewardFnError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardFnError(
            f"reward_fn {spec} returned {value!r}; expected a finite number or None"
        )
    return float(value)


def import_function(spec: str, setting: str) -> Callable[..., Any]:
    """Import `module:function` named by the setting `setting`; RewardFnError with a clear
    message when that fails."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardFnError(f"{setting} must be 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardFnError(f"cannot import {setting} module {module_name!r}: {exc}") from exc
    function = getattr(module, attr, None)
    if not callable(function):
        raise RewardFnError(f"{module_name!r} has no callable {attr!r} ({setting} {spec!r})")
    return function


def load_reward_fn(spec: str, kwargs: dict[str, Any] | None = None) -> RewardFn:
    """Import `module:function`; RewardFnError with a clear message when that fails."""
    function = import_function(spec, "reward_fn")
    return RewardFn(spec=spec, function=function, kwargs=dict(kwargs or {}))
