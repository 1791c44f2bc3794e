"""Clients of a running gateway shared by the gateway's integration tests."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis

from clawrl.common.records import Turn, decode_entry, turn_id
from clawrl.gateway.sessions import session_epoch

TIMEOUT = httpx.Timeout(60.0)


@dataclass
class GatewayHandle:
    name: str
    url: str
    grpc_port: int
    stream: str
    redis_url: str
    child: Any
    ready: bool = False
    _redis: Any = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def openai(self, api_key: str = "none", **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def chat(self, messages, headers=None, **body) -> httpx.Response:
        return httpx.post(
            f"{self.base_url}/chat/completions",
            json={"messages": messages, "max_tokens": 4, **body},
            headers=headers or {},
            timeout=TIMEOUT,
        )

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis.Redis.from_url(self.redis_url)
        return self._redis

    def turns(self, session_id: str | None = None) -> list[Turn]:
        """Every finished Turn on this gateway's stream (of one session when given)."""
        turns = [decode_entry(f, Turn) for _, f in self.redis.xrange(self.stream, "-", "+")]
        return [t for t in turns if session_id is None or t.session_id == session_id]

    def wait_turns(self, session_id: str, count: int, timeout_s: float = 15) -> list[Turn]:
        deadline = time.monotonic() + timeout_s
        while True:
            turns = self.turns(session_id)
            if len(turns) >= count or time.monotonic() > deadline:
                return turns
            time.sleep(0.05)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=TIMEOUT).text
        total = 0.0
        for line in text.splitlines():
            if not (line.startswith(name + "{") or line.startswith(name + " ")):
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def turn_of(session_id: str, first_request_id: str, index: int) -> str:
    """The id of a session's turn whose state the request `first_request_id` (a response `id`)
    made: turn ids are `{session_id}:{epoch}:{index}`, the epoch derived from that request."""
    return turn_id(session_id, session_epoch(first_request_id), index)


def user(text: str) -> dict:
    return {"role": "user", "content": text}
