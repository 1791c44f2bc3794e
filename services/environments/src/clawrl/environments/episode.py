"""One episode: a task played as one session through the gateway, in a sandbox leased from the
sandbox service.

    lease (allocate, heartbeats) -> reset (the task's files, tools, checker) ->
    loop: the model's reply (official openai client, the tools' schemas, X-Session-Id) ->
          each tool call runs in the sandbox -> its observation goes back as a `tool` message
          (the gateway records it as the turn's next state)
    -> /evaluate runs the checker -> close the lease -> post the outcome for the session

A reply without a tool call ends the episode; so does the task's step limit (commands run):
then one more request carries the last observation, with `X-Session-Done: true`. Training
episodes are main turns marked `X-Episode: true` and get their outcome posted
(`POST /v1/outcomes`, which also ends the session); evaluation episodes are side turns (served,
never recorded or trained) and post nothing. The lease is closed on every way out, cancellation
included (`SandboxClient.lease`); a runner killed outright leaves it to the lease's TTL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from clawrl.common.logs import log_context
from clawrl.environments.client import (
    Lease,
    PoolExhausted,
    SandboxClient,
    SandboxServiceError,
)
from clawrl.environments.prompting import PromptStyle, opening_messages
from clawrl.environments.runner_metrics import RunnerMetrics
from clawrl.environments.tasks import Task

log = logging.getLogger(__name__)

FINGERPRINT = re.compile(r"clawrl-policy-v(\d+)")
OUTCOMES_PATH = "/outcomes"  # under the gateway's /v1 (the openai client's base URL)
SANDBOX_ERRORS = (SandboxServiceError, httpx.HTTPError)


def reply_version(fingerprint: str | None) -> int | None:
    """The policy version a gateway reply names in its system_fingerprint (`clawrl-policy-vN`);
    None when it names none (not a clawrl gateway)."""
    match = FINGERPRINT.fullmatch(fingerprint or "")
    return int(match.group(1)) if match else None


def clip(text: str, limit: int) -> str:
    """At most `limit` characters: the head and the tail, with a note of what was cut between
    (a long output would fill the model's context; its end often says what went wrong)."""
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit} characters cut ...]\n"
    keep = max(0, limit - len(note))
    head = keep // 2
    return text[:head] + note + text[len(text) - (keep - head) :]


def task_meta(task: Task) -> dict[str, Any]:
    """What /reset puts in the sandbox: the task's files, tools, checker and command limit."""
    return {
        "task_name": task.id,
        "instruction": task.instruction,
        "files": dict(task.files),
        "tools": list(task.tools),
        "checker": task.checker,
        "limits": {"timeout_s": task.command_timeout_s},
    }


@dataclass(frozen=True)
class EpisodeConfig:
    model: str
    temperature: float = 0.7
    max_tokens: int = 128
    prompt: PromptStyle = "few-shot"
    # True: main turns marked X-Episode, recorded and trained, the outcome posted. False: side
    # turns (held-out evaluation, base rates): never recorded, nothing posted.
    train: bool = True
    post_outcome: bool = True
    max_observation_chars: int = 2000
    heartbeat_s: float = 10.0
    allocate_attempts: int = 30  # 429 (every lease taken): retried this often
    allocate_backoff_s: float = 2.0
    transcript: bool = False  # keep the episode's messages (less the prompt's demos) in the result


@dataclass
class EpisodeResult:
    """One finished episode, as the runner writes it (one JSON line each)."""

    session_id: str
    task_id: str
    family: str
    split: str
    steps: int = 0  # commands run in the sandbox
    requests: int = 0  # model requests (turns)
    passed: bool | None = None  # the checker's verdict; None when it did not run
    score: float | None = None
    ended: str = ""  # answered | length | step_limit | error
    versions: list[int] = field(default_factory=list)  # distinct reply versions, in order
    outcome: str = ""  # the gateway's answer: accepted | late | skipped | failed
    error: str = ""  # `stage: message` when the episode broke off
    checker_output: str = ""
    duration_s: float = 0.0
    transcript: list[dict[str, Any]] | None = None  # from the instruction on (config.transcript)

    @property
    def policy_version(self) -> int | None:
        """The version every reply came from; None when none came or a sync split them."""
        return self.versions[0] if len(self.versions) == 1 else None

    def saw(self, version: int | None) -> None:
        if version is not None and version not in self.versions:
            self.versions.append(version)

    def record(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "task_id": self.task_id,
            "family": self.family,
            "split": self.split,
            "steps": self.steps,
            "requests": self.requests,
            "passed": self.passed,
            "score": self.score,
            "ended": self.ended,
            "policy_version": self.policy_version,
            "policy_versions": self.versions,
            "outcome": self.outcome,
            "error": self.error,
            "checker_output": self.checker_output,
            "duration_s": round(self.duration_s, 3),
            **({"transcript": self.transcript} if self.transcript is not None else {}),
        }


class EpisodeError(Exception):
    """The episode broke off at `stage` (one of runner_metrics.STAGES)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage


class Episode:
    """Plays one task once (`play`); the clients are the runner's, shared by its episodes."""

    def __init__(
        self,
        task: Task,
        session_id: str,
        *,
        sandbox: SandboxClient,
        gateway: openai.AsyncOpenAI,
        config: EpisodeConfig,
        metrics: RunnerMetrics,
    ) -> None:
        self.task = task
        self.session_id = session_id
        self.sandbox = sandbox
        self.gateway = gateway
        self.config = config
        self.metrics = metrics
        self.result = EpisodeResult(session_id, task.id, task.family, task.split)

    async def play(self) -> EpisodeResult:
        """The episode to its end; failures are in the result (counted and logged), only
        cancellation propagates (after the lease is closed)."""
        started = time.monotonic()
        self.metrics.active.inc()
        try:
            with log_context(session_id=self.session_id):
                await self._leased()
                await self._post_outcome()
        except EpisodeError as exc:
            self.result.ended, self.result.error = "error", str(exc)
            self.metrics.failures.labels(exc.stage).inc()
            log.warning(
                "episode of %s broke off: %s",
                self.task.id,
                exc,
                extra={"session_id": self.session_id},
            )
        finally:
            self.metrics.active.dec()
            self.result.duration_s = time.monotonic() - started
        self._count()
        return self.result

    def _count(self) -> None:
        result = self.result
        verdict = "error" if result.passed is None else ("passed" if result.passed else "failed")
        self.metrics.episodes.labels(result.split, result.family, verdict).inc()
        self.metrics.steps.observe(result.steps)
        self.metrics.duration.observe(result.duration_s)

    async def _leased(self) -> None:
        """Lease, reset, converse, evaluate; the lease is closed on the way out. A 429 takes
        no lease (only /allocate answers it), so the whole block is retried."""
        config = self.config
        for attempt in range(config.allocate_attempts):
            entered = False
            try:
                async with self.sandbox.lease(
                    self.task.id, heartbeat_s=config.heartbeat_s, request_id=self.session_id
                ) as lease:
                    entered = True
                    await self._in_sandbox(lease)
                return
            except asyncio.CancelledError:
                if not entered:
                    await asyncio.shield(self._close_unseen_lease())
                raise
            except PoolExhausted:
                await asyncio.sleep(config.allocate_backoff_s * min(attempt + 1, 5))
            except SANDBOX_ERRORS as exc:  # the body's own are EpisodeErrors already
                raise EpisodeError("allocate", _describe(exc)) from exc
        raise EpisodeError("allocate", f"every lease taken after {config.allocate_attempts} tries")

    async def _close_unseen_lease(self) -> None:
        """Cancelled inside /allocate: the service may have granted a lease whose id never
        arrived. The same request id names it again (a repeated request_id gets the same
        lease), so it is closed now instead of at its TTL."""
        try:
            await self.sandbox.close(await self.sandbox.allocate(self.task.id, self.session_id))
        except SANDBOX_ERRORS as exc:
            log.warning("a lease granted during cancellation is left to its TTL: %s", exc)

    async def _in_sandbox(self, lease: Lease) -> None:
        try:
            reset = await lease.reset(
                task_meta(self.task), task_timeouts={"eval": self.task.checker_timeout_s}
            )
        except SANDBOX_ERRORS as exc:
            raise EpisodeError("reset", _describe(exc)) from exc
        await self._converse(lease, reset.tool_schemas)
        try:
            verdict = await lease.evaluate()
        except SANDBOX_ERRORS as exc:
            raise EpisodeError("evaluate", _describe(exc)) from exc
        self.result.passed, self.result.score = verdict.passed, verdict.score
        self.result.checker_output = clip(verdict.output, 500)

    async def _converse(self, lease: Lease, tools: list[dict[str, Any]]) -> None:
        """Model turns and tool calls until a reply calls no tool or the step limit."""
        messages = opening_messages(self.task.instruction, self.config.prompt)
        first = len(messages) - 1  # the instruction: where a transcript starts
        try:
            await self._turns(lease, tools, messages)
        finally:
            if self.config.transcript:
                self.result.transcript = messages[first:]

    async def _turns(
        self, lease: Lease, tools: list[dict[str, Any]], messages: list[dict[str, Any]]
    ) -> None:
        task, result = self.task, self.result
        at_limit = False
        while True:
            choice = await self._ask(messages, tools, done=at_limit)
            reply = choice.message.model_dump(exclude_none=True)
            calls = choice.message.tool_calls or []
            if at_limit or not calls:
                messages.append(reply)  # the transcript's end; no request follows it
                if at_limit:
                    result.ended = "step_limit"
                else:
                    result.ended = "length" if choice.finish_reason == "length" else "answered"
                return
            messages.append(reply)
            for call in calls:
                observation = await self._run(lease, call)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
            at_limit = result.steps >= task.max_steps
            # An evaluation records nothing: no request is needed to deliver the last result.
            if at_limit and not self.config.train:
                result.ended = "step_limit"
                return

    async def _ask(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, done: bool
    ) -> Any:
        """One model request of the session; the reply's first choice."""
        config = self.config
        headers = {"X-Session-Id": self.session_id}
        if config.train:
            headers |= {"X-Turn-Type": "main", "X-Episode": "true"}
        else:
            headers["X-Turn-Type"] = "side"
        if done:
            headers["X-Session-Done"] = "true"
        try:
            reply = await self.gateway.chat.completions.create(
                model=config.model,
                messages=messages,
                tools=tools,
                temperature=config.temperature,
                max_tokens=config.max_tokens,
                extra_headers=headers,
            )
        except openai.APIError as exc:
            raise EpisodeError("model", _describe(exc)) from exc
        self.result.requests += 1
        self.result.saw(reply_version(reply.system_fingerprint))
        if not reply.choices:
            raise EpisodeError("model", "a reply with no choices")
        return reply.choices[0]

    async def _run(self, lease: Lease, call: Any) -> str:
        """One tool call in the sandbox: its observation (an unrunnable call's is the error)."""
        if self.result.steps >= self.task.max_steps:
            self.metrics.tool_calls.labels("over_limit").inc()
            return f"[not run: the task's limit of {self.task.max_steps} commands is reached]"
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            self.metrics.tool_calls.labels("bad_json").inc()
            return "[not run: the arguments must be a JSON object]"
        self.result.steps += 1
        self.metrics.tool_calls.labels("run").inc()
        try:
            found = await lease.exec_tool(call.function.name, arguments)
        except SANDBOX_ERRORS as exc:
            raise EpisodeError("tool", _describe(exc)) from exc
        return clip(found.observation, self.config.max_observation_chars)

    async def _post_outcome(self) -> None:
        """The checker's verdict for the whole session (training episodes only)."""
        result = self.result
        if not (self.config.train and self.config.post_outcome) or result.passed is None:
            result.outcome = "skipped"
            return
        try:
            answer = await post_outcome(
                self.gateway,
                self.session_id,
                float(result.score or 0.0),
                self.task.id,
                result.checker_output,
            )
        except openai.APIError as exc:
            result.outcome = "failed"
            raise EpisodeError("outcome", _describe(exc)) from exc
        result.outcome = str(answer.get("status", ""))


async def post_outcome(
    gateway: openai.AsyncOpenAI, session_id: str, outcome: float, task_id: str, detail: str
) -> dict[str, Any]:
    """POST /v1/outcomes for an episode's session (the gateway stores it for the judge and ends
    the session); the gateway's answer. The same outcome posted twice is stored once, so the
    client's retries (5xx, 429, lost connections) are safe."""
    body = {"session_id": session_id, "outcome": outcome, "task_id": task_id, "detail": detail}
    answer = await gateway.post(
        OUTCOMES_PATH,
        body=body,
        cast_to=object,
        options={"headers": {"X-Session-Id": session_id}},
    )
    return answer if isinstance(answer, dict) else {}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]
