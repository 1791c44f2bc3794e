"""Judging one turn: the mode's rules (rl, opd, combine) over votes, hints, the teacher and the
reward plug-in, giving one Sample (trained or masked, never none) and its audit record.

Engine trouble (`EngineUnavailable`) propagates: the caller waits and retries the whole turn.
A turn that cannot be judged raises `MalformedTurn` (dead-lettered with the reason)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clawrl.common.feedback import FeedbackSettings
from clawrl.common.proto.records_pb2 import FinalizeReason, MaskReason
from clawrl.common.records import Sample
from clawrl.common.sglang_client import EngineRequestError, EngineUnavailable
from clawrl.judge.backends import Prepared, PromptTooLong, VoteBackend
from clawrl.judge.episodes import EpisodeWait, record_episode
from clawrl.judge.feedback import TurnFeedback, merged_reward
from clawrl.judge.hint_fns import HintFn, HintFnFailed
from clawrl.judge.hints import (
    BY_OVERLAP,
    HintVote,
    Selection,
    accepted_hints,
    by_length,
    candidates,
    parse_hint_vote,
    sequence_optimal,
    token_optimal,
    topk_overlap,
)
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.prompts import (
    Budget,
    JudgeInput,
    hint_messages,
    judge_input,
    prm_messages,
    prm_yes_no_messages,
)
from clawrl.judge.rewards import RewardFn
from clawrl.judge.samples import TRAINED, base_sample, mixed_policy, set_mask, set_teacher
from clawrl.judge.settings import Mode
from clawrl.judge.teacher import (
    Teacher,
    TeacherMismatch,
    TeacherSignal,
    merge_signals,
    narrow_topk,
)
from clawrl.judge.turns import MalformedTurn, TurnView
from clawrl.judge.verdicts import LogprobPRM
from clawrl.judge.votes import agreement, majority, parse_boxed, wire_votes

log = logging.getLogger(__name__)

KIND = {"rl": "rl", "opd": "opd", "combine": "combined"}
MAX_FIT_ROUNDS = 6
AUDIT_TEXT_CHARS = 20_000


@dataclass
class Vote:
    """One vote as the audit trail keeps it."""

    text: str
    score: int | None
    error: str | None = None
    hint: str | None = None

    def record(self, keep_text: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"score": self.score}
        if keep_text:
            out["text"] = self.text[:AUDIT_TEXT_CHARS]
        if self.error:
            out["error"] = self.error
        if self.hint is not None:
            out["hint"] = self.hint
        return out


@dataclass
class Judgement:
    """A turn's sample and audit record. `promotable`: a 0-scored rl turn with a next state,
    trained instead of masked when its session has no effective sample yet (decided in
    Redis at commit, see store.py)."""

    sample: Sample
    audit: dict[str, Any]
    promotable: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    # The turn's explicit feedback as read before judging; None: feedback is not read.
    feedback: TurnFeedback | None = None
    # An episode's turn: what its wait for the outcome found; None: not an episode's turn.
    episode: EpisodeWait | None = None

    @property
    def effective(self) -> bool:
        return self.sample.mask_reason == TRAINED


def score_label(score: float | None) -> str:
    if score is None:
        return "none"
    return "positive" if score > 0 else "negative" if score < 0 else "zero"


class Judge:
    """Judges one turn at a time (call concurrently; it keeps no per-turn state)."""

    def __init__(
        self,
        *,
        mode: Mode,
        metrics: JudgeMetrics,
        votes: int = 3,
        backend: VoteBackend | None = None,
        teacher: Teacher | None = None,
        reward_fn: RewardFn | None = None,
        budget: Budget | None = None,
        min_hint_chars: int = 10,
        keep_vote_text: bool = True,
        promote_first_in_session: bool = True,
        feedback: FeedbackSettings | None = None,
        logprob_prm: LogprobPRM | None = None,
        hint_fn: HintFn | None = None,
        hint_votes: bool = True,
        hint_candidates: int = 1,
        hint_select: Selection = "longest",
        select_top_k: int = 8,
        prm_step_coef: float = 1.0,
    ) -> None:
        if mode != "rl" and teacher is None:
            raise ValueError(f"mode {mode} needs a teacher (an SGLang-API judge engine)")
        if backend is None and mode != "opd" and reward_fn is None:
            raise ValueError(f"mode {mode} needs a vote backend for its PRM votes (or a reward_fn)")
        if backend is None and mode != "rl" and hint_votes:
            raise ValueError(f"mode {mode} asks hint votes: it needs a vote backend")
        if hint_candidates > 1 and hint_select in BY_OVERLAP and teacher and not teacher.student:
            raise ValueError(f"hint_select {hint_select} needs the student (the policy engine)")
        self.mode = mode
        self.metrics = metrics
        self.m = votes
        self.backend = backend
        self.teacher = teacher
        self.reward_fn = reward_fn
        self.budget = budget or Budget()
        self.min_hint_chars = min_hint_chars
        self.keep_vote_text = keep_vote_text
        self.promote_first_in_session = promote_first_in_session
        self.feedback = feedback or FeedbackSettings(enabled=False)
        self.hint_fn = hint_fn
        self.hint_votes = hint_votes and backend is not None
        self.hint_candidates = hint_candidates
        self.hint_select = hint_select
        self.select_top_k = select_top_k
        self.logprob_prm = logprob_prm  # set: the PRM score is its yes/no verdict, not votes
        self.prm_step_coef = prm_step_coef  # an episode's turn: the weight of its step score

    async def judge(
        self,
        view: TurnView,
        feedback: TurnFeedback | None = None,
        episode: EpisodeWait | None = None,
    ) -> Judgement:
        """`feedback`: the turn's explicit feedback (worker), None when it is not read;
        `episode`: what an episode's turn found waiting for its outcome (worker), else None."""
        turn = view.turn
        sample = base_sample(view, self.mode)
        audit: dict[str, Any] = {
            "turn_id": turn.turn_id,
            "session_id": turn.session_id,
            "turn_index": turn.turn_index,
            "policy_version": turn.policy_version,
            "weight_version": turn.weight_version,
            "mode": self.mode,
            "finalize_reason": FinalizeReason.Name(turn.finalize_reason),
            "response": turn.response_text[:AUDIT_TEXT_CHARS],
            "next_state": [m for m in view.next_state],
        }
        judgement = Judgement(sample=sample, audit=audit, feedback=feedback, episode=episode)
        if feedback is not None and feedback.entries:
            audit["feedback"] = feedback.audit()
        if turn.probe:
            # A probe (the chart's `helm test` hook): it checks that turns are recorded; its
            # reply is no user's, and a reward_fn that scores the reply alone would train it.
            set_mask(sample, MaskReason.MASK_REASON_PROBE)
        elif not turn.response_ids:
            set_mask(sample, MaskReason.MASK_REASON_EMPTY_RESPONSE)
        elif turn.unknown_weights:
            # Served by weights of no known version (a restarted engine's base model): trained
            # as any version, it would teach the policy what another model did.
            set_mask(sample, MaskReason.MASK_REASON_UNKNOWN_VERSION)
        elif mixed_policy(turn):
            set_mask(sample, MaskReason.MASK_REASON_MIXED_POLICY)
        elif turn.finalize_reason == FinalizeReason.FINALIZE_REASON_RETRY_ORPHAN:
            # The client retried this turn's request and never used its reply: the retry's
            # own turn is the one trained.
            set_mask(sample, MaskReason.MASK_REASON_RETRY_ORPHAN)
        elif turn.history_mismatch:
            # The next request did not extend this turn's conversation (the client edited or
            # truncated it, or another conversation took the session id): its last message is
            # not known to answer this reply, so it judges nothing.
            set_mask(sample, MaskReason.MASK_REASON_HISTORY_MISMATCH)
        elif episode is not None and episode.outcome is None:
            # No outcome in time (episodes.py): no reward is made up for it.
            audit["episode"] = episode.audit()
            set_mask(sample, MaskReason.MASK_REASON_NO_OUTCOME)
            self.metrics.episode_turns.labels("no_outcome").inc()
        elif episode is not None:
            await self._episode(view, judgement)
        elif self.mode == "rl":
            await self._rl(view, judgement)
        elif self.mode == "opd":
            await self._opd(view, judgement)
        else:
            await self._combine(view, judgement)
        audit.update(
            reward=sample.reward,
            reward_source=sample.reward_source,
            hint=sample.hint,
            hint_source=sample.hint_source,
            has_teacher=sample.has_teacher,
            mask_reason=MaskReason.Name(sample.mask_reason),
            promoted=False,
            judged_at=time.time(),
            timings=judgement.timings,
        )
        self.metrics.samples.labels(KIND[self.mode], score_label(audit.get("score"))).inc()
        if not judgement.effective:
            self.metrics.masked.labels(MaskReason.Name(sample.mask_reason)).inc()
        return judgement

    # ----- modes ---------------------------------------------------------------------------

    async def _rl(self, view: TurnView, j: Judgement) -> None:
        score = await self._score(view, j)
        sample = j.sample
        if score is None and not view.has_next_state:
            set_mask(sample, MaskReason.MASK_REASON_NO_NEXT_STATE)
        elif not score:
            set_mask(sample, MaskReason.MASK_REASON_NEUTRAL_SCORE)
            j.promotable = view.has_next_state and self.promote_first_in_session
        else:
            sample.reward = score
            set_mask(sample, None)

    async def _opd(self, view: TurnView, j: Judgement) -> None:
        sample = j.sample
        if self._explicit(j) is not None:
            self._feedback_used(j, "reward_unused")  # opd trains on the teacher only
        try:
            hints = await self._hints(view, j)
        except HintFnFailed as exc:
            self._hint_fn_failed(j, exc)
            return
        if not hints:
            none = MaskReason.MASK_REASON_NO_HINT if view.has_next_state else None
            set_mask(sample, none or MaskReason.MASK_REASON_NO_NEXT_STATE)
            return
        await self._teach(view, hints, j)
        set_mask(sample, None)

    async def _combine(self, view: TurnView, j: Judgement) -> None:
        """hint & ±1: teacher + reward; hint & 0: teacher, reward 0; no hint & ±1: reward
        only (has_teacher false: an exact zero distillation term); neither: masked."""
        sample = j.sample
        explicit = self._explicit(j)
        comment = self._comment(j)
        if not view.has_next_state and self.reward_fn is None and not comment and explicit is None:
            set_mask(sample, MaskReason.MASK_REASON_NO_NEXT_STATE)
            return
        try:
            score, hints = await _gather(self._score(view, j), self._hints(view, j))
        except HintFnFailed as exc:
            self._hint_fn_failed(j, exc)
            return
        if hints:
            await self._teach(view, hints, j)
        if score:
            sample.reward = score
        if hints or score:
            set_mask(sample, None)
        elif not view.has_next_state:
            set_mask(sample, MaskReason.MASK_REASON_NO_NEXT_STATE)
        else:
            set_mask(sample, MaskReason.MASK_REASON_NO_SIGNAL)

    async def _episode(self, view: TurnView, j: Judgement) -> None:
        """An episode's turn with its outcome: trained with (2 * outcome - 1) + prm_step_coef *
        step score (episodes.episode_score), whatever the score; the step score is `_score`'s,
        not asked when the coefficient is 0. combine also distils from a hint when one is found."""
        step = self._score(view, j) if self.prm_step_coef else _nothing()
        hints = self._hints(view, j) if self.mode == "combine" else _nothing()
        try:
            score, found = await _gather(step, hints)
        except HintFnFailed as exc:
            self._hint_fn_failed(j, exc)
            return
        if found:
            await self._teach(view, found, j)
        assert j.episode is not None
        record_episode(j.sample, j.audit, j.episode, score, self.prm_step_coef)
        set_mask(j.sample, None)
        self.metrics.episode_turns.labels("merged").inc()

    # ----- signals -------------------------------------------------------------------------

    def _explicit(self, j: Judgement) -> float | None:
        return j.feedback.reward if j.feedback is not None else None

    def _comment(self, j: Judgement) -> str:
        """The feedback's comment when it may serve as the hint (opd, combine), else ""."""
        if j.feedback is None or not self.feedback.comment_as_hint:
            return ""
        return j.feedback.comment or ""

    def _feedback_used(self, j: Judgement, use: str) -> None:
        self.metrics.feedback.labels(use).inc()
        j.audit.setdefault("feedback", {}).setdefault("used", []).append(use)

    async def _score(self, view: TurnView, j: Judgement) -> float | None:
        """The judge's score (`_judged_score`) met with the turn's explicit reward, if any."""
        explicit = self._explicit(j)
        if explicit is not None and self.feedback.combine == "override":
            self._feedback_used(j, "reward_override")
            j.sample.reward_source = "feedback"
            j.audit["score"] = explicit
            return explicit
        judged = await self._judged_score(view, j)
        if explicit is None:
            return judged
        self._feedback_used(j, "reward_weighted")
        source = j.sample.reward_source
        j.sample.reward_source = f"{source}+feedback" if judged is not None else "feedback"
        j.audit["judge_score"] = judged
        j.audit["score"] = merged_reward(explicit, judged, "weighted", self.feedback.weight)
        return j.audit["score"]

    async def _judged_score(self, view: TurnView, j: Judgement) -> float | None:
        """The reward_fn's reward, else the PRM's: the majority of m votes, or the yes/no
        log-prob verdict with `logprob_prm` (None: no next state to judge)."""
        if self.reward_fn is not None:
            score = await self.reward_fn(view)
            j.sample.reward_source = self.reward_fn.source
            j.audit["score"] = score
            return score
        if not view.has_next_state:
            return None
        data = judge_input(view.messages, view.response_message, view.next_state, self.budget)
        if self.logprob_prm is not None:
            prompt = self._fit(view, data, prm_yes_no_messages, "prm")
            assert prompt.input_ids is not None  # an SGLang-API backend (checked by settings)
            started = time.perf_counter()
            verdict = await self.logprob_prm.verdict(prompt.input_ids)
            elapsed = time.perf_counter() - started
            self.metrics.judge_latency.labels("prm").observe(elapsed)
            self.metrics.votes.labels("prm", verdict.outcome).inc()
            j.timings["prm_s"] = elapsed
            j.sample.votes[:] = wire_votes([verdict.score])
            j.sample.reward_source = "prm:logprob"
            j.audit["prm_logprob"] = verdict.record()
            j.audit["score"] = verdict.score or 0
            return float(verdict.score or 0)
        prompt = self._fit(view, data, prm_messages, "prm")
        started = time.perf_counter()
        votes = await self._votes(prompt, "prm", lambda text: (parse_boxed(text), None))
        elapsed = time.perf_counter() - started
        self.metrics.judge_latency.labels("prm").observe(elapsed)
        j.timings["prm_s"] = elapsed
        scores = [v.score for v in votes]
        result = majority(scores)
        self.metrics.agreement.observe(agreement(scores, result))
        j.sample.votes[:] = wire_votes(scores)
        j.sample.reward_source = "prm"
        j.audit["votes"] = [v.record(self.keep_vote_text) for v in votes]
        j.audit["score"] = result
        return float(result)

    async def _hints(self, view: TurnView, j: Judgement) -> list[str]:
        """Hint candidates from the first source that gives any, in order: the explicit
        feedback's comment, the hint plug-in, the judge's hint votes; [] when none does.
        HintFnFailed when the plug-in fails (the caller masks the turn)."""
        found: list[str] = []
        source = ""
        if comment := self._comment(j):
            self._feedback_used(j, "hint")
            found, source = [comment], "feedback"
        if not found and view.has_next_state and self.hint_fn is not None:
            found = candidates(await self.hint_fn(view), self.min_hint_chars)
            source = self.hint_fn.source
        if not found and view.has_next_state and self.hint_votes:
            found, source = await self._hint_votes(view, j), "judge"
        found = found[: self.hint_candidates]
        self.metrics.hints.labels("accepted" if found else "none").inc()
        self.metrics.hint_sources.labels(source.split(":")[0] if found else "none").inc()
        if found:
            j.sample.hint_source = source
            j.sample.hint = found[0]
            j.audit["hint_candidates"] = found
        return found

    async def _hint_votes(self, view: TurnView, j: Judgement) -> list[str]:
        """The accepted hints of the judge's m hint votes: all of them (deduplicated, in vote
        order) when several are kept, else the longest (the most instructive)."""
        data = judge_input(view.messages, view.response_message, view.next_state, self.budget)
        prompt = self._fit(view, data, hint_messages, "hint")
        started = time.perf_counter()

        def parse(text: str) -> tuple[int | None, str]:
            vote = parse_hint_vote(text)
            return vote.score, vote.hint

        votes = await self._votes(prompt, "hint", parse)
        elapsed = time.perf_counter() - started
        self.metrics.judge_latency.labels("hint").observe(elapsed)
        j.timings["hint_s"] = elapsed
        j.audit["hint_votes"] = [v.record(self.keep_vote_text) for v in votes]
        hint_votes = [HintVote(v.score, v.hint or "") for v in votes]
        hints = accepted_hints(hint_votes, self.min_hint_chars)
        if self.hint_candidates > 1 or not hints:
            return hints
        return [hints[by_length(hints, "longest")]]

    def _hint_fn_failed(self, j: Judgement, exc: HintFnFailed) -> None:
        """Masked, not failed: a broken plug-in costs its turns' signal, never the turns."""
        log.warning("turn %s masked: %s", j.sample.sample_id, exc)
        self.metrics.hint_fn_errors.inc()
        j.audit["hint_fn_error"] = str(exc)
        set_mask(j.sample, MaskReason.MASK_REASON_HINT_FN_FAILED)

    async def _teach(self, view: TurnView, hints: list[str], j: Judgement) -> None:
        """Teacher log-probs after the hinted prompt; with several candidates one is picked by
        `hint_select` (by length: only the chosen one is scored; by top-K agreement: each is,
        see `_select`)."""
        assert self.teacher is not None
        started = time.perf_counter()
        try:
            if len(hints) == 1 or self.hint_select not in BY_OVERLAP:
                chosen = 0 if len(hints) == 1 else by_length(hints, self.hint_select)
                hinted = hints[chosen]
                prompt_ids = self.teacher.hinted_prompt_ids(view.messages, view.tools, hinted)
                signal = await self.teacher.score(prompt_ids, view.turn.response_ids)
                j.audit["hinted_prompt_tokens"] = len(prompt_ids)
            else:
                chosen, signal = await self._select(view, hints, j)
        except (EngineRequestError, TeacherMismatch) as exc:
            raise MalformedTurn(f"teacher log-probs failed: {exc}") from exc
        except ValueError as exc:  # the policy template cannot render the hinted messages
            raise MalformedTurn(f"cannot render the hinted prompt: {exc}") from exc
        elapsed = time.perf_counter() - started
        self.metrics.teacher_latency.observe(elapsed)
        j.timings["teacher_s"] = elapsed
        j.sample.hint = hints[chosen]
        j.sample.hint_candidates = len(hints)
        if len(hints) > 1:
            self.metrics.hint_selections.labels(self.hint_select).inc()
            j.audit["hint_chosen"] = chosen
        set_teacher(j.sample, signal)

    async def _select(
        self, view: TurnView, hints: list[str], j: Judgement
    ) -> tuple[int, TeacherSignal]:
        """Each candidate scored with its top-K, and the student's top-K on the turn's own
        prompt; k* by their overlap (OpenClaw-RL: O[k, t] = |top-K(student, t) & top-K(teacher
        k, t)|) -> (the candidate reported as the hint, the signal: candidate k*'s, or for
        token_optimal each token's own k*)."""
        assert self.teacher is not None
        turn, k = view.turn, self.select_top_k
        asked = max(k, self.teacher.top_k)
        prompts = [self.teacher.hinted_prompt_ids(view.messages, view.tools, h) for h in hints]
        *signals, student = await asyncio.gather(
            *(self.teacher.score(p, turn.response_ids, asked) for p in prompts),
            self.teacher.student_topk(list(turn.prompt_ids), turn.response_ids, k),
        )
        overlaps = [
            topk_overlap(student, narrow_topk(s.topk_ids, s.topk_logprobs, asked, k)[0], k)
            for s in signals
        ]
        if self.hint_select == "sequence_optimal":
            chosen = sequence_optimal(overlaps)
            choice = [chosen] * len(turn.response_ids)
        else:
            choice = token_optimal(overlaps)
            chosen = max(range(len(hints)), key=lambda c: (choice.count(c), -c))
        merged = merge_signals(signals, choice)
        ids, lps = narrow_topk(merged.topk_ids, merged.topk_logprobs, asked, self.teacher.top_k)
        j.audit["hint_overlaps"] = [sum(row) for row in overlaps]
        j.audit["hinted_prompt_tokens"] = len(prompts[chosen])
        return chosen, TeacherSignal(merged.logprobs, self.teacher.top_k, ids, lps)

    def _fit(
        self,
        view: TurnView,
        data: JudgeInput,
        build: Callable[[JudgeInput], list[dict[str, str]]],
        kind: str,
    ) -> Prepared:
        """The prepared prompt, shortened further until it fits the judge's context."""
        assert self.backend is not None
        budget = self.budget
        for _ in range(MAX_FIT_ROUNDS):
            try:
                prompt = self.backend.prepare(build(data))
            except PromptTooLong:
                budget = budget.halved()
                data = judge_input(view.messages, view.response_message, view.next_state, budget)
                data = JudgeInput(data.context, data.response, data.next_state, data.shortened + 1)
                continue
            except ValueError as exc:  # the judge template cannot render it
                raise MalformedTurn(f"cannot render the judge prompt: {exc}") from exc
            if data.shortened:
                self.metrics.shortened.labels(kind).inc()
            return prompt
        raise MalformedTurn("the judge prompt does not fit the judge model's context")

    async def _votes(
        self, prompt: Prepared, kind: str, parse: Callable[[str], tuple[int | None, Any]]
    ) -> list[Vote]:
        """m concurrent votes; a rejected vote is dropped (score None), an unavailable
        backend fails the turn (EngineUnavailable)."""
        assert self.backend is not None
        replies = await asyncio.gather(
            *(self.backend.vote(prompt) for _ in range(self.m)), return_exceptions=True
        )
        votes = []
        for reply in replies:
            if isinstance(reply, EngineUnavailable):
                raise reply
            if isinstance(reply, EngineRequestError):
                votes.append(Vote(text="", score=None, error=reply.message))
                self.metrics.votes.labels(kind, "failed").inc()
                continue
            if isinstance(reply, BaseException):
                raise reply
            score, hint = parse(reply)
            votes.append(Vote(text=reply, score=score, hint=hint if kind == "hint" else None))
            self.metrics.votes.labels(kind, "valid" if score is not None else "invalid").inc()
        return votes


async def _nothing() -> None:
    """A signal that is not asked."""
    return None


async def _gather(score_coro, hint_coro) -> tuple[float | None, str]:
    """Both signals concurrently; the first failure propagates once both have finished."""
    score, hint = await asyncio.gather(score_coro, hint_coro, return_exceptions=True)
    for result in (score, hint):
        if isinstance(result, BaseException):
            raise result
    return score, hint  # type: ignore[return-value]
