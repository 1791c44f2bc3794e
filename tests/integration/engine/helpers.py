"""Small clients of the engine's HTTP API shared by the engine's integration tests."""

from __future__ import annotations

import json
import re

import httpx

TIMEOUT = httpx.Timeout(120.0)


def generate(url: str, **body) -> dict:
    response = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(url: str, max_new_tokens: int = 8, **body) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, **body.pop("sampling_params", {})}
    return generate(url, sampling_params=params, **body)


def stream_events(url: str, **body) -> list:
    """Every `data:` payload of a streaming /generate, `[DONE]` included as a string."""
    events = []
    with httpx.stream(
        "POST", f"{url}/generate", json={**body, "stream": True}, timeout=TIMEOUT
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(url: str, name: str, **labels) -> float:
    """The value of one sample of /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
