"""Episodes at the judge (Track 2): a turn recorded with X-Episode waits for its episode's
outcome (posted by the agent runner through the gateway's POST /v1/outcomes, stored as
clawrl.common.episodes describes), and its reward merges that outcome with the turn's own step
score by OpenClaw-RL's formula (`episode_score`). An episode with no outcome in time expires:
its turns are masked (MASK_REASON_NO_OUTCOME), never trained with a made-up reward.

Waiting costs no engine call: the turns of a worker that wait are polled together, one script
call per waiting episode every `poll_interval_s` (at once when a turn starts waiting), in one
pipeline. The expiry is decided in Redis, atomically against the gateway's store of the
outcome, so an outcome is either merged by every turn of its episode or by none (then it is
late: audited and counted by the gateway)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from clawrl.common.episodes import EXPIRED, EpisodeSettings, Outcome, outcome_key
from clawrl.common.records import Sample
from clawrl.common.redis_client import REDIS_ERRORS, Script, run_script
from clawrl.common.redis_text import text
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.turns import MalformedTurn

log = logging.getLogger(__name__)


def episode_score(outcome: float, step_score: float | None, coef: float) -> float:
    """The reward of an episode's turn: (2 * outcome - 1) + coef * step_score.

    OpenClaw-RL's terminal-rl (generate.py, `_build_samples`): base = 2 * accuracy - 1, with
    accuracy the task's evaluation in [0, 1] (so +1 success, -1 failure), discounted by
    discount ** steps_from_end with discount fixed at 1.0 (no discount); then score = base +
    prm_coef * prm, where prm is the turn's PRM verdict (+1, -1, or 0 when unparsable) and a turn
    the PRM did not score counts 0 (`prm_turn_scores.get(turn_idx, 0.0)`); prm_coef defaults to
    1.0 (PRM_STEP_COEF, --prm-step-coef). Here the step score is the judge's own score of the
    turn (PRM votes or yes/no verdict, a reward_fn, or explicit feedback), None (no next state
    to judge, or not asked) counting 0 as there."""
    return (2.0 * outcome - 1.0) + coef * (step_score or 0.0)


@dataclass(frozen=True)
class EpisodeWait:
    """What an episode's turn found: the outcome, or None when the episode expired without
    one, and how long it waited for it."""

    outcome: Outcome | None
    waited_s: float = 0.0

    def audit(self) -> dict[str, Any]:
        if self.outcome is None:
            return {"outcome": None, "expired": True, "waited_s": round(self.waited_s, 3)}
        return {
            "outcome": self.outcome.outcome,
            "task_id": self.outcome.task_id,
            "detail": self.outcome.detail,
            "waited_s": round(self.waited_s, 3),
        }


def record_episode(
    sample: Sample, audit: dict[str, Any], wait: EpisodeWait, step: float | None, coef: float
) -> float:
    """Write an episode's turn's reward, outcome, step score and task into its sample and audit
    record; the reward. `sample.reward_source` names the step score's source as judged."""
    assert wait.outcome is not None
    score = episode_score(wait.outcome.outcome, step, coef)
    sample.reward = score
    sample.outcome = wait.outcome.outcome
    sample.step_score = step or 0.0
    sample.task_id = wait.outcome.task_id
    source = sample.reward_source
    sample.reward_source = f"outcome+{source}" if step is not None and source else "outcome"
    audit["episode"] = {**wait.audit(), "step_score": step, "prm_step_coef": coef}
    audit["score"] = score
    return score


# KEYS: the episode's outcome hash. ARGV: now (unix s), timeout_s, touch (0/1), ttl.
# Returns the decided state (the outcome's JSON, or 'expired'), or nil while still undecided.
# touch: a turn of the episode began waiting now: the expiry counts from the latest such time.
POLL = """
local state = redis.call('HGET', KEYS[1], 'state')
if state then return state end
local now = tonumber(ARGV[1])
local active = tonumber(redis.call('HGET', KEYS[1], 'active') or '0')
if ARGV[3] == '1' and now > active then
  active = now
  redis.call('HSET', KEYS[1], 'active', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
if active > 0 and now - active >= tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'state', 'expired', 'expired_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return 'expired'
end
return false
"""


class OutcomeWaiter:
    """The turns of one worker (one shard: `prefix` is the shard's outcome key prefix) waiting
    for their episodes' outcomes. `run` polls while the worker runs."""

    def __init__(
        self, redis: Redis, prefix: str, settings: EpisodeSettings, metrics: JudgeMetrics
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.settings = settings
        self.metrics = metrics
        self._poll = Script(redis, POLL)
        self._waiting: dict[str, list[asyncio.Future]] = {}  # session state -> its turns
        self._touched: set[str] = set()
        self._wake = asyncio.Event()

    async def wait(self, session_state: str) -> EpisodeWait:
        """The outcome of the episode `session_state` (`{session_id}:{epoch}`), or None once it
        expired. MalformedTurn when the stored outcome cannot be read."""
        started = time.monotonic()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(session_state, []).append(future)
        self._touched.add(session_state)
        self._wake.set()
        self.metrics.outcome_waiting.inc()
        try:
            outcome = await future
        finally:
            self.metrics.outcome_waiting.dec()
            waiters = self._waiting.get(session_state, [])
            if future in waiters:  # cancelled (shutdown): the others wait on
                waiters.remove(future)
                if not waiters:
                    del self._waiting[session_state]
        waited = time.monotonic() - started
        self.metrics.outcome_wait.observe(waited)
        return EpisodeWait(outcome, waited)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop` is set (or cancelled): every poll_interval_s, and at once when a
        turn starts waiting."""
        while not stop.is_set():
            # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow a cancellation that
            # meets its timeout, and this loop would then never end.
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({woken}, timeout=self.settings.poll_interval_s)
            finally:
                woken.cancel()
            self._wake.clear()
            if self._waiting:
                await self.poll_once()

    async def poll_once(self) -> None:
        """One look at every waiting episode; decided ones wake their turns. Redis trouble: the
        turns wait on (counted, logged) and the next poll tries again."""
        states = list(self._waiting)
        touched, self._touched = self._touched, set()
        s, now = self.settings, time.time()
        calls = [
            ([outcome_key(self.prefix, state)],
             [now, s.outcome_timeout_s, int(state in touched), s.ttl_s])
            for state in states
        ]  # fmt: skip
        try:
            results = await run_script(self.redis, self._poll, calls)
        except REDIS_ERRORS as exc:
            self._touched |= touched
            self.metrics.errors.labels("outcome").inc()
            log.warning("cannot look for %d episodes' outcomes: %s", len(states), exc)
            return
        for state, result in zip(states, results, strict=True):
            if result is not None:
                self._decide(state, text(result))

    def _decide(self, state: str, decided: str) -> None:
        try:
            outcome: Outcome | None = None if decided == EXPIRED else Outcome.from_json(decided)
            error = None
        except (ValueError, KeyError, TypeError) as exc:
            outcome, error = None, MalformedTurn(f"the episode's outcome is unreadable: {exc}")
        if outcome is None and error is None:
            log.info("episode %s has no outcome %.0f s after its latest turn: its turns are "
                     "masked", state, self.settings.outcome_timeout_s)  # fmt: skip
        for future in self._waiting.pop(state, []):
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(outcome)
