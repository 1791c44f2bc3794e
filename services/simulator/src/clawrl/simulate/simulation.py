"""The scripted users: concurrent multi-turn sessions through the gateway with the official
`openai` client. Each session asks `turns` questions of its scenario in one conversation,
answering each reply with the user's remark on it and the next question, and closes with
`X-Session-Done`."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import openai

from clawrl.simulate.evaluation import reply_version
from clawrl.simulate.report import TurnOutcome
from clawrl.simulate.scenarios import PREFERENCE, Scenario

log = logging.getLogger(__name__)


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
    scenario: Scenario = PREFERENCE
    label: str = ""  # names the user in progress lines (one of several tenants)
    remarks: str = "fixed"  # the user's wording: fixed (one remark per verdict) or varied


@dataclass
class Progress:
    check_name: str = "liked"
    label: str = ""
    started: float = field(default_factory=time.monotonic)
    sessions_done: int = 0
    failures: int = 0
    newest_version: int = 0
    outcomes: list[TurnOutcome] = field(default_factory=list)

    def line(self) -> str:
        recent = self.outcomes[-50:]
        passed = sum(o.ok for o in recent) / len(recent) if recent else 0.0
        return (
            f"[{time.monotonic() - self.started:6.0f}s] {self.label}sessions "
            f"{self.sessions_done}  turns {len(self.outcomes)}  {self.check_name}(last 50) "
            f"{passed:.2f}  policy v{self.newest_version}  failed requests {self.failures}"
        )


class Simulation:
    def __init__(self, client: openai.AsyncOpenAI, model: str, config: SimulationConfig) -> None:
        self.client = client
        self.model = model
        self.config = config
        label = f"{config.label}: " if config.label else ""
        self.progress = Progress(check_name=config.scenario.check_name, label=label)
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
        scenario = self.config.scenario
        rng = random.Random(self.config.seed * 1_000_003 + index)
        session = self.session_id(index)
        items = [scenario.draw(rng) for _ in range(self.config.turns)]
        # The varied wording draws from the same RNG after the questions: they stay the same.
        wording = rng if self.config.remarks == "varied" else None
        system = [{"role": "system", "content": scenario.system_prompt}]
        messages = [
            *(system if scenario.system_prompt else []),
            {"role": "user", "content": scenario.text(items[0])},
        ]
        for turn, item in enumerate(items):
            asked = await self._ask(messages, session)
            if asked is None:
                return  # the gateway finalises the session when it goes idle
            answer, version = asked
            self.progress.outcomes.append(TurnOutcome(version, scenario.check(answer, item)))
            following = items[turn + 1] if turn + 1 < len(items) else None
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": scenario.remark(answer, item, following, wording)},
            ]
        # The last remark is the next state of the last answer; this request closes the session.
        await self._ask(messages, session, max_tokens=1, headers={"X-Session-Done": "true"})
