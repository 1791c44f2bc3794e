"""The sandbox service's pure parts: tool calls -> commands, results -> observations, the wire
models, task limits against defaults and ceilings, the local backend's argv, and settings."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from pydantic import ValidationError

from clawrl.environments import tools
from clawrl.environments.backend import ExecResult, Limits, SpecError
from clawrl.environments.leases import outcome_of, parse_arguments
from clawrl.environments.local import LocalBackend, _read_capped, limit_of, safe_relative
from clawrl.environments.protocol import (
    ResetRequest,
    TaskLimits,
    TaskMeta,
    eval_timeout,
    limits_of,
    spec_of,
    user_message,
)
from clawrl.environments.settings import EnvironmentsSettings, LocalSandboxSettings


def test_shell_exec_takes_camels_extra_arguments_and_a_timeout() -> None:
    call = tools.command_of("shell_exec", {"id": "s1", "command": "ls -l", "block": True})
    assert call == tools.Command("ls -l")
    assert tools.command_of("shell_exec", {"command": "x", "timeout": 3}).timeout_s == 3.0


@pytest.mark.parametrize(
    ("name", "arguments", "words"),
    [
        ("shell_exec", {}, "'command'"),
        ("shell_exec", {"command": "   "}, "'command'"),
        ("shell_exec", {"command": "ls", "timeout": -1}, "timeout"),
        ("shell_exec", {"command": "ls", "timeout": "5"}, "timeout"),
        ("shell_write_content_to_file", {"file_path": "a"}, "'content'"),
        ("shell_write_content_to_file", {"file_path": "/etc/x", "content": ""}, "outside"),
        ("shell_write_content_to_file", {"file_path": "a/../../x", "content": ""}, "outside"),
        ("shell_view", {"id": "s"}, "unknown tool 'shell_view'"),
    ],
)
def test_bad_tool_calls_say_why(name: str, arguments: dict, words: str) -> None:
    with pytest.raises(tools.ToolCallError, match=words):
        tools.command_of(name, arguments)


def test_writing_a_file_quotes_its_path_and_sends_content_on_stdin() -> None:
    call = tools.command_of(
        "shell_write_content_to_file", {"file_path": "it's/a b.txt", "content": "$(rm -rf /)"}
    )
    assert call.stdin == b"$(rm -rf /)"
    assert "'/workspace/it'\"'\"'s/a b.txt'" in call.command
    assert "rm -rf" not in call.command
    assert tools.workspace_path("/workspace/x/../y") == "/workspace/y"


def test_tool_schemas_are_openai_function_tools() -> None:
    schemas = tools.tool_schemas()
    assert [s["function"]["name"] for s in schemas] == list(tools.TOOL_NAMES)
    for schema in schemas:
        assert schema["type"] == "function"
        params = schema["function"]["parameters"]
        assert set(params["required"]) <= set(params["properties"])


@pytest.mark.parametrize(
    ("result", "text"),
    [
        (ExecResult("out\n", "", 0), "out\n"),
        (ExecResult("", "", 0), "[no output]"),
        (ExecResult("a", "err\n", 2), "a\nerr\n[exit code 2]"),
        (ExecResult("", "", -1, timed_out=True, duration_s=2.04), "[killed: timed out after 2.0s]"),
        (ExecResult("x" * 3, "", 0, truncated=True), "xxx\n[output truncated]"),
        (ExecResult("", "e", 152, limit="cpu"), "e\n[exit code 152] [limit hit: cpu]"),
    ],
)
def test_observations_never_hide_a_failure(result: ExecResult, text: str) -> None:
    assert tools.observation(result) == text


def test_arguments_may_be_an_object_or_openais_json_string() -> None:
    assert parse_arguments('{"command": "ls"}') == {"command": "ls"}
    assert parse_arguments({"command": "ls"}) == {"command": "ls"}
    assert parse_arguments(None) == {} and parse_arguments("") == {}
    with pytest.raises(tools.ToolCallError, match="JSON"):
        parse_arguments("{nope")
    with pytest.raises(tools.ToolCallError, match="object"):
        parse_arguments("[1]")


def test_outcomes() -> None:
    assert outcome_of(ExecResult("", "", 0)) == "ok"
    assert outcome_of(ExecResult("", "", 1)) == "failed"
    assert outcome_of(ExecResult("", "", -1, timed_out=True)) == "timeout"


def test_task_limits_fill_from_defaults_and_stop_at_the_ceiling() -> None:
    defaults, ceilings = Limits(), Limits(cpu_s=60, memory_mb=2048, timeout_s=100.0)
    assert limits_of(TaskLimits(), defaults, ceilings) == defaults
    asked = limits_of(TaskLimits(memory_mb=2048, timeout_s=5), defaults, ceilings)
    assert (asked.memory_mb, asked.timeout_s, asked.pids) == (2048, 5.0, defaults.pids)
    with pytest.raises(SpecError, match=r"cpu_s=61 \(max 60\)"):
        limits_of(TaskLimits(cpu_s=61), defaults, ceilings)
    with pytest.raises(SpecError, match=r"limits\.pids"):
        Limits(pids=0)


def test_task_meta_keeps_openclaw_rl_keys_and_refuses_typos_in_limits() -> None:
    meta = TaskMeta.model_validate(
        {"task_name": "t", "instruction": "do", "task_path": "tasks/t", "files": {"a": "1"}}
    )
    assert user_message(meta) == "Task name: t\nTask instruction: do"
    spec = spec_of(meta, Limits(), Limits())
    assert spec.files == {"a": "1"} and spec.tools == ()
    with pytest.raises(ValidationError, match="pid"):
        TaskMeta.model_validate({"limits": {"pid": 3}})
    with pytest.raises(ValidationError, match="task_meta"):
        ResetRequest.model_validate({"lease_id": "x"})


def test_eval_timeout_reads_openclaw_rls_task_timeouts() -> None:
    assert eval_timeout({"eval": 30, "reset_session": 5}) == 30.0
    assert eval_timeout({"eval": "12.5"}) == 12.5
    assert eval_timeout({"eval": 0}) is None
    assert eval_timeout({"eval": "soon"}) is None
    assert eval_timeout(None) is None


def test_seeded_paths_stay_in_the_workspace() -> None:
    assert str(safe_relative("a/b.txt")) == "a/b.txt"
    for bad in ("", "/etc/passwd", "../x", "a/../../x", "a\x00b"):
        with pytest.raises(SpecError):
            safe_relative(bad)


def test_limits_are_read_from_the_exit() -> None:
    assert limit_of(128 + signal.SIGXCPU, b"") == "cpu"
    assert limit_of(128 + signal.SIGXFSZ, b"") == "file_size"
    assert limit_of(0, b"sh: 1: Cannot fork\n") == "pids"
    assert limit_of(1, b"bash: fork: retry: Resource temporarily unavailable") == "pids"
    assert limit_of(1, b"error") is None


async def test_output_is_capped_and_the_rest_drained() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(b"a" * 70000 + b"b" * 70000)
    reader.feed_eof()
    kept, cut = await _read_capped(reader, 100)
    assert kept == b"a" * 100 and cut and reader.at_eof()
    reader = asyncio.StreamReader()
    reader.feed_data(b"short")
    reader.feed_eof()
    assert await _read_capped(reader, 100) == (b"short", False)


def test_the_sandbox_sees_only_its_tools_and_no_network() -> None:
    backend = LocalBackend(LocalSandboxSettings(base_tools=["sh", "cat"]))
    backend._base_tools = {"sh": "/usr/bin/dash", "cat": "/usr/bin/cat"}
    args = backend.bwrap_args(Path("/srv/s1"), backend.tool_binds(["python3"]))
    joined = " ".join(args)
    for flag in ("--unshare-net", "--unshare-pid", "--unshare-user", "--die-with-parent",
                 "--disable-userns", "--clearenv", "--new-session"):  # fmt: skip
        assert flag in args, flag
    bound = [args[i + 2] for i, a in enumerate(args) if a == "--ro-bind" and "bin" in args[i + 2]]
    assert sorted(bound) == ["/usr/bin/cat", "/usr/bin/python3", "/usr/bin/sh"]
    assert "--bind /srv/s1/workspace /workspace" in joined
    assert args[-2:] == ["--remount-ro", "/"]  # last, after every mount
    with pytest.raises(SpecError, match="no-such-tool"):
        backend.tool_binds(["no-such-tool"])
    assert backend.resolve_tool("../../bin/sh") is None and backend.resolve_tool("a/b") is None


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")
    monkeypatch.setenv("CLAWRL_LEASES__MAX_LEASES", "3")
    monkeypatch.setenv("CLAWRL_SANDBOX_LIMITS__PIDS", "16")
    monkeypatch.setenv("CLAWRL_ENVIRONMENTS_SERVER__TOKEN", "s3cret")
    settings = EnvironmentsSettings()
    assert settings.leases.max_leases == 3
    assert settings.sandbox_limits.limits().pids == 16
    assert settings.environments_server.bearer_token() == "s3cret"
    monkeypatch.setenv("CLAWRL_SANDBOX_LIMITS__TIMEOUT_S", "5000")
    with pytest.raises(ValidationError, match="above sandbox_max_limits: timeout_s"):
        EnvironmentsSettings()
