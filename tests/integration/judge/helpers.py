"""Judge test helpers: turns built like the gateway records them, a judge settings object
isolated per test (own streams, own key prefix), and waiting for samples on a real Redis."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from redis.asyncio import Redis

from clawrl.common.proto.records_pb2 import FinalizeReason
from clawrl.common.records import Sample, Turn, decode_entry
from clawrl.common.streams import publish
from clawrl.judge.settings import JudgeSettings


def said(text: str) -> list[dict[str, Any]]:
    """A next state: the user's reply."""
    return [{"role": "user", "content": text}]


def make_turn(
    session: str,
    index: int,
    *,
    user: str = "What is 2+3?",
    response: str = "It is 5.",
    next_state: list[dict[str, Any]] | None = None,
    response_ids: list[int] | None = None,
    prompt_ids: list[int] | None = None,
    tools: list[dict[str, Any]] | None = None,
    legacy_next_state: bool = False,
) -> Turn:
    """A finalised turn; `next_state=None` = finalised with no next state (session done)."""
    ids = response_ids if response_ids is not None else [100 + index, 200, 300]
    turn = Turn(
        turn_id=f"{session}:{index}",
        session_id=session,
        turn_index=index,
        model="smollm2-tiny",
        policy_version=3,
        weight_version="3",
        messages_json=json.dumps([{"role": "user", "content": user}]),
        tools_json=json.dumps(tools) if tools else "",
        prompt_ids=prompt_ids if prompt_ids is not None else [1, 2, 3, 4],
        response_ids=ids,
        response_logprobs=[-0.5 - 0.1 * i for i in range(len(ids))],
        response_text=response,
        response_message_json=json.dumps({"role": "assistant", "content": response}),
        finish_reason="stop",
        temperature=0.7,
        top_p=0.9,
    )
    turn.finalized_at.GetCurrentTime()
    if next_state:
        if legacy_next_state:
            turn.next_state_json = json.dumps(next_state[-1])
        else:
            turn.next_state_messages_json.extend(json.dumps(m) for m in next_state)
            turn.next_state_json = json.dumps(next_state[-1])
        turn.finalize_reason = FinalizeReason.FINALIZE_REASON_NEXT_STATE
    else:
        turn.finalize_reason = FinalizeReason.FINALIZE_REASON_SESSION_DONE
    return turn


def judge_settings(redis_url: str, **sections: dict[str, Any]) -> JudgeSettings:
    """Settings on fresh stream names and key prefix; `sections` override (e.g. judging={})."""
    tag = uuid.uuid4().hex[:8]
    base: dict[str, dict[str, Any]] = {
        "redis": {
            "url": redis_url,
            "turns_stream": f"t:{tag}:turns",
            "samples_stream": f"t:{tag}:samples",
            "deadletter_stream": f"t:{tag}:dead",
        },
        "audit": {"stream": f"t:{tag}:judgements"},
        "workers": {"key_prefix": f"t:{tag}:judge", "consumer": "w1", "block_ms": 100},
        "judge_server": {"grpc_port": 0, "metrics_port": 0},
        "backend": {"engine_url": None},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return JudgeSettings(**base)


async def put_turns(redis: Redis, settings: JudgeSettings, turns: list[Turn]) -> None:
    for turn in turns:
        await publish(redis, settings.redis.turns_stream, turn, 10_000)


async def samples(redis: Redis, settings: JudgeSettings) -> list[Sample]:
    entries = await redis.xrange(settings.redis.samples_stream)
    return [decode_entry(fields, Sample) for _, fields in entries]


async def wait_samples(
    redis: Redis, settings: JudgeSettings, count: int, timeout_s: float = 20
) -> list[Sample]:
    deadline = time.monotonic() + timeout_s
    while await redis.xlen(settings.redis.samples_stream) < count:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    return await samples(redis, settings)


async def pending(redis: Redis, settings: JudgeSettings) -> int:
    summary = await redis.xpending(settings.redis.turns_stream, settings.workers.group)
    return int(summary["pending"])


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> bool:
    """Whether `check` holds within `timeout_s` (generous: a loaded host is slow)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def consumed(redis: Redis, settings: JudgeSettings) -> Callable[[], Awaitable[bool]]:
    """Every turn read by the judges' group and acknowledged (nothing new, nothing pending)."""

    async def check() -> bool:
        groups = await redis.xinfo_groups(settings.redis.turns_stream)
        return any(
            g["name"] in (settings.workers.group, settings.workers.group.encode())
            and g["lag"] == 0
            and g["pending"] == 0
            for g in groups
        )

    return check


def expected_teacher(engine: str, prompt_ids: list[int], response_ids: list[int], top_k: int):
    """The engine's prompt log-probs of the whole sequence (from position 0, a different
    request than the judge's), at the response positions."""
    reply = httpx.post(
        f"{engine}/generate",
        json={"input_ids": prompt_ids + response_ids, "return_logprob": True,
              "logprob_start_len": 0, "top_logprobs_num": top_k,
              "sampling_params": {"max_new_tokens": 0}},
        timeout=60,
    ).json()["meta_info"]  # fmt: skip
    n = len(response_ids)
    return reply["input_token_logprobs"][-n:], reply.get("input_top_logprobs", [])[-n:]
