"""The scripted users: concurrent multi-turn sessions through the gateway with the official
`openai` client. Each session asks `turns` word problems in one conversation, answering each
reply with its verdict and the next question, and closes with `X-Session-Done`."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from dataclasses import dataclass, field

import openai

from clawrl.simulate.problems import SYSTEM_PROMPT, Problem, is_correct, make_problem, next_message
from clawrl.simulate.report import TurnOutcome

log = logging.getLogger(__name__)

FINGERPRINT = re.compile(r"clawrl-policy-v(\d+)")


@dataclass
class SimulationConfig:
    sessions: int  # 0 = until stopped or until_version
    turns: int
    concurrency: int
    until_version: int | None
    max_tokens: int
    temperature: float
    seed: int
    run_id: str


@dataclass
class Progress:
    started: float = field(default_factory=time.monotonic)
    sessions_done: int = 0
    failures: int = 0
    newest_version: int = 0
    outcomes: list[TurnOutcome] = field(default_factory=list)

    def line(self) -> str:
        recent = self.outcomes[-50:]
        accuracy = sum(o.correct for o in recent) / len(recent) if recent else 0.0
        return (
            f"[{time.monotonic() - self.started:6.0f}s] sessions {self.sessions_done}  turns "
            f"{len(self.outcomes)}  accuracy(last 50) {accuracy:.2f}  policy v{self.newest_version}"
            f"  failed requests {self.failures}"
        )


def reply_version(fingerprint: str | None) -> int:
    match = FINGERPRINT.fullmatch(fingerprint or "")
    return int(match.group(1)) if match else 0


class Simulation:
    def __init__(self, client: openai.AsyncOpenAI, model: str, config: SimulationConfig) -> None:
        self.client = client
        self.model = model
        self.config = config
        self.progress = Progress()
        self.stop = asyncio.Event()

    def session_id(self, index: int) -> str:
        return f"sim-{self.config.run_id}-{index}"

    async def run(self) -> Progress:
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=self.config.concurrency)

        async def feeder() -> None:
            index = 0
            while not self.stop.is_set() and (
                self.config.sessions == 0 or index < self.config.sessions
            ):
                await queue.put(index)
                index += 1
            for _ in range(self.config.concurrency):
                await queue.put(-1)

        async def worker() -> None:
            while (index := await queue.get()) >= 0:
                await self.session(index)
                self.progress.sessions_done += 1
                print(self.progress.line(), flush=True)

        await asyncio.gather(feeder(), *(worker() for _ in range(self.config.concurrency)))
        return self.progress

    async def _ask(self, messages: list[dict], session: str, **extra) -> tuple[str, int] | None:
        """The reply's text and the policy version that produced it; None when it failed."""
        try:
            reply = await self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                max_tokens=extra.pop("max_tokens", self.config.max_tokens),
                temperature=self.config.temperature,
                extra_headers={"X-Session-Id": session, **extra.pop("headers", {})},
            )
        except openai.APIError as exc:
            self.progress.failures += 1
            log.warning("session %s: request failed: %s", session, exc)
            return None
        version = reply_version(reply.system_fingerprint)
        self.progress.newest_version = max(self.progress.newest_version, version)
        until = self.config.until_version
        if until is not None and version >= until:
            self.stop.set()
        return reply.choices[0].message.content or "", version

    async def session(self, index: int) -> None:
        rng = random.Random(self.config.seed * 1_000_003 + index)
        session = self.session_id(index)
        problems: list[Problem] = [make_problem(rng) for _ in range(self.config.turns)]
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problems[0].question},
        ]
        for turn, problem in enumerate(problems):
            asked = await self._ask(messages, session)
            if asked is None:
                return  # the gateway finalises the session when it goes idle
            answer, version = asked
            self.progress.outcomes.append(TurnOutcome(version, is_correct(answer, problem)))
            following = problems[turn + 1] if turn + 1 < len(problems) else None
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": next_message(answer, problem, following)},
            ]
        # The last verdict is the next state of the last answer; this request closes the session.
        await self._ask(messages, session, max_tokens=1, headers={"X-Session-Done": "true"})
