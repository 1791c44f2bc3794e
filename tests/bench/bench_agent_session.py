"""Benchmark of a realistic agent session through the gateway: a ~13k-token first request (an
agent's system prompt: identity, tool rules, skills and injected workspace files, plus 12 tool
definitions, generated deterministically), then 5 turns, sent with the official openai client
(streaming) to `clawrl-gateway` in front of the CPU engine serving SmolLM2-135M with a 16,384-token
context (RoPE stretched: the model was trained on 8,192), as `make run` serves it. Prints the time
to first token of each turn, its prompt and cached tokens (from the engine's metrics) and the
first turn's prefill rate. Asserts nothing.

    .venv/bin/python tests/bench/bench_agent_session.py [--model NAME] [--prompt-tokens 13000]
        [--turns 5] [--new-tokens 32] [--context-length 16384] [--disable-radix-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from bench_engine import BIN, free_port, start_engine
from openai import OpenAI
from transformers import AutoTokenizer

from clawrl.common.models import resolve_model_dir, served_model_name
from clawrl.common.settings import ModelSettings

TOOLS = {
    "read": ("Read a file from the workspace. Returns its text with line numbers.",
             {"path": "Path relative to the workspace root.",
              "offset": "First line to read (1-based).", "limit": "Most lines to read."}),
    "write": ("Create or overwrite a file in the workspace with the given content.",
              {"path": "Path relative to the workspace root.", "content": "The full new text."}),
    "edit": ("Replace an exact string in a file. The old string must occur exactly once.",
             {"path": "File to edit.", "old_string": "Text to replace.",
              "new_string": "Replacement text."}),
    "exec": ("Run a shell command in the workspace and return its output and exit code.",
             {"command": "The command line.", "timeout_s": "Seconds before it is killed.",
              "background": "Run detached and return a process id."}),
    "process": ("Inspect or stop a background process started by exec.",
                {"action": "One of list, poll, log, kill.", "id": "The process id."}),
    "web_search": ("Search the web and return titles, addresses and snippets.",
                   {"query": "What to search for.", "count": "Number of results (1-10)."}),
    "web_fetch": ("Fetch a web page and return its readable text.",
                  {"url": "The address to fetch.", "max_chars": "Truncate after this many."}),
    "browser": ("Control a headless browser: open pages, click, type, take snapshots.",
                {"action": "open, click, type, snapshot or close.", "target": "URL or element."}),
    "message": ("Send a message to the user on their chat channel.",
                {"channel": "Channel id.", "text": "The message text."}),
    "cron": ("Schedule, list or cancel reminders and recurring jobs.",
             {"action": "add, list or remove.", "schedule": "Cron expression.",
              "task": "What to do when it fires."}),
    "sessions_list": ("List the agent's other sessions with their last activity.",
                      {"limit": "Most sessions to return."}),
    "memory_search": ("Search the agent's long-term memory notes for relevant passages.",
                      {"query": "What to look for.", "top_k": "Number of passages."}),
}  # fmt: skip

SECTIONS = ("AGENTS.md", "SOUL.md", "TOOLS.md", "USER.md", "MEMORY.md", "HEARTBEAT.md")
SUBJECTS = (
    "the workspace",
    "a pull request",
    "the deployment notes",
    "the user's calendar",
    "a failing test",
    "the build log",
    "the release checklist",
    "a shell command",
    "the project's README",
    "the memory file",
    "a background process",
    "a web page",
)
VERBS = (
    "check",
    "summarise",
    "update",
    "read",
    "never delete",
    "confirm before changing",
    "keep a note of",
    "verify",
    "quote exactly",
    "ask about",
    "double-check",
    "archive",
)
REASONS = (
    "so the user can trust the result",
    "because mistakes there are costly",
    "since the user reads replies on a phone",
    "to keep the history auditable",
    "as agreed in an earlier session",
    "unless the user says otherwise",
)

TURNS = [
    "List the files in the workspace and tell me which one holds the deployment notes.",
    "Open the deployment notes and summarise the rollback steps in three bullet points.",
    "The build failed with 'module not found: yaml'. What should I run to fix it?",
    "Remind me tomorrow at 9 to review the release checklist.",
    "Thanks. Write a short note to MEMORY.md about what we did today.",
]


def tools_param() -> list[dict]:
    """The 12 tools as OpenAI function definitions."""
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        p: {"type": "string", "description": d} for p, d in params.items()
                    },
                    "required": [next(iter(params))],
                },
            },
        }
        for name, (description, params) in TOOLS.items()
    ]


def system_prompt(tokenizer, target_tokens: int, tools: list[dict]) -> str:
    """A deterministic agent system prompt; with the tools' JSON it comes to ~target_tokens."""
    rng = random.Random(13)
    budget = target_tokens - len(tokenizer.encode(json.dumps(tools)))
    head = (
        "You are a personal assistant running inside an agent runtime on the user's machine. "
        "You can call tools; call them only when needed, one step at a time, and report what "
        "you did. Never invent tool results. Ask before destructive actions.\n\n## Tooling\n"
        + "".join(f"- {name}: {desc}\n" for name, (desc, _) in TOOLS.items())
        + "\n## Safety\nDo not exfiltrate secrets. Refuse requests that harm others.\n"
    )
    parts, used = [head], len(tokenizer.encode(head))
    section = 0
    while used < budget:
        if section % 8 == 0:
            name = SECTIONS[(section // 8) % len(SECTIONS)]
            para = f"\n## Workspace file: {name}\n"
        else:
            sentences = [
                f"{rng.choice(VERBS).capitalize()} {rng.choice(SUBJECTS)} "
                f"{rng.choice(REASONS)} (rule {section}.{i})."
                for i in range(rng.randint(3, 6))
            ]
            para = "- " + " ".join(sentences) + "\n"
        parts.append(para)
        used += len(tokenizer.encode(para))
        section += 1
    return "".join(parts)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


class Servers:
    """redis-server, the CPU engine and the gateway, stopped on exit."""

    def __init__(self, model: str, context_length: int, engine_args: list[str]):
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-agent-"))
        self.procs: list[subprocess.Popen] = []
        redis_port, engine_port = free_port(), free_port()
        gateway_port, grpc_port = free_port(), free_port()
        self.spawn(
            "redis",
            [shutil.which("redis-server") or "redis-server", "--port", str(redis_port),
             "--bind", "127.0.0.1", "--save", ""],
        )  # fmt: skip
        self.engine_url = f"http://127.0.0.1:{engine_port}"
        self.procs.append(
            start_engine(model, engine_port, self.workdir / "engine.log",
                         "--context-length", str(context_length), *engine_args)
        )  # fmt: skip
        gateway = self.spawn(
            "gateway",
            [str(BIN / "clawrl-gateway"), "--host", "127.0.0.1", "--port", str(gateway_port),
             "--grpc-port", str(grpc_port), "--model", model, "--engine-url", self.engine_url,
             "--redis-url", f"redis://127.0.0.1:{redis_port}/0"],
            # The setting make run shares with every process: the gateway admits what is served.
            # A cold 13k-token prefill on a busy 2-core host outlasts the default 600 s wait.
            env={"CLAWRL_CONFIG": "/nonexistent",
                 "CLAWRL_MODEL__CONTEXT_LENGTH": str(context_length),
                 "CLAWRL_SERVING__ENGINE_TIMEOUT_S": "3600"},
        )  # fmt: skip
        self.gateway_url = f"http://127.0.0.1:{gateway_port}"
        deadline = time.monotonic() + 600
        while not self.ready(f"{self.gateway_url}/readyz"):
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway not ready; see {self.workdir / 'gateway.log'}")
            time.sleep(0.3)

    @staticmethod
    def ready(url: str) -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def turn(
    client: OpenAI, model: str, messages: list[dict], tools: list[dict], new_tokens: int
) -> dict:
    """One streamed turn: TTFT, total time, usage, and the assistant message to append."""
    start = time.perf_counter()
    ttft, content, calls, usage = None, [], {}, None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=tools,
        max_tokens=new_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Session-Id": "bench-agent"},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content or delta.tool_calls:
                ttft = ttft if ttft is not None else time.perf_counter() - start
            if delta.content:
                content.append(delta.content)
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += (call.function and call.function.name) or ""
                entry["arguments"] += (call.function and call.function.arguments) or ""
    total = time.perf_counter() - start
    message: dict = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [
            {"id": c["id"] or f"call_{i}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"] or "{}"}}
            for i, c in calls.items()
        ]  # fmt: skip
    return {"ttft": ttft if ttft is not None else total, "total": total, "usage": usage,
            "message": message}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, default=13000, help="system prompt + tools")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32, help="max_tokens per turn")
    parser.add_argument("--context-length", type=int, default=16384)
    parser.add_argument("--disable-radix-cache", action="store_true", help="the engine keeps none")
    args = parser.parse_args()
    settings = ModelSettings(path=args.model)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(settings))
    tools = tools_param()
    system = system_prompt(tokenizer, args.prompt_tokens, tools)
    cache = "without" if args.disable_radix_cache else "with"
    print(
        f"Agent session through the gateway: {args.model}, context {args.context_length}, "
        f"{len(tools)} tools, {cache} the prefix cache, {os.cpu_count()} CPUs (shared host)"
    )
    extra = ["--disable-radix-cache"] if args.disable_radix_cache else []
    with Servers(args.model, args.context_length, extra) as servers:
        # No retries: a retried turn would hide its first attempt's time.
        client = OpenAI(
            base_url=f"{servers.gateway_url}/v1", api_key="bench", timeout=3600, max_retries=0
        )
        messages: list[dict] = [{"role": "system", "content": system}]
        print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'new':>6} {'TTFT s':>8} {'total s':>8}")
        for index in range(args.turns):
            messages.append({"role": "user", "content": TURNS[index % len(TURNS)]})
            cached_before = metric(servers.engine_url, "clawrl_engine_cached_prompt_tokens_total")
            row = turn(client, served_model_name(settings), messages, tools, args.new_tokens)
            cached = metric(servers.engine_url, "clawrl_engine_cached_prompt_tokens_total")
            cached -= cached_before
            prompt = row["usage"].prompt_tokens if row["usage"] else 0
            print(
                f"{index + 1:>4} {prompt:>7} {cached:>7.0f} {prompt - cached:>6.0f} "
                f"{row['ttft']:>8.1f} {row['total']:>8.1f}",
                flush=True,
            )
            if index == 0:
                first = (prompt - cached) / row["ttft"]
            messages.append(row["message"])
            for call in row["message"].get("tool_calls", []):
                # The model asked for a tool: answer like a runtime that ran it.
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
        print(f"first turn: {first:.0f} prompt tokens/s prefilled (the session's cold start)")


if __name__ == "__main__":
    main()
