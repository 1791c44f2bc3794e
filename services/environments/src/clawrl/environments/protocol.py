"""The lease API's wire format: request bodies, the task a /reset describes, and how that task
becomes a `SandboxSpec`. Pure: validation and conversion, no I/O.

Fields shared with OpenClaw-RL's pool server (`terminal-rl/remote/pool_server.py`) keep its
names: `task_key`, `request_id`, `lease_id`, `task_meta`, `run_ctx`, `task_timeouts` (its `eval`
key), `tool_call {name, arguments}`. What `task_meta` holds is ours (theirs names a Terminal-Bench
task directory and Docker image): see `TaskMeta`. Unknown keys are accepted and ignored, as their
server does, so a request built for theirs is not refused for an extra field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from clawrl.environments.backend import Limits, SandboxSpec, SpecError


class TaskLimits(BaseModel):
    """A task's own limits; a missing one takes the service's default, and none may pass the
    service's ceiling (sandbox_max_limits)."""

    model_config = ConfigDict(extra="forbid")

    cpu_s: int | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    pids: int | None = Field(None, gt=0)
    file_size_mb: int | None = Field(None, gt=0)
    timeout_s: float | None = Field(None, gt=0)
    output_bytes: int | None = Field(None, gt=0)


class TaskMeta(BaseModel):
    """What /reset puts in the sandbox. `task_name` and `instruction` are OpenClaw-RL's keys (they
    make the user message); the rest is how this service describes a task."""

    model_config = ConfigDict(extra="allow")

    task_name: str = "unknown"
    instruction: str = ""
    files: dict[str, str] = Field(
        default_factory=dict, description="workspace-relative path -> text, seeded at reset"
    )
    tools: list[str] = Field(default_factory=list, description="executables beside the base set")
    setup: str | None = Field(None, description="shell script run once after seeding")
    checker: str | None = Field(None, description="script /evaluate runs: exit 0 = pass")
    checker_tools: list[str] = Field(
        default_factory=list, description="executables the checker needs beyond `tools`"
    )
    limits: TaskLimits = Field(default_factory=TaskLimits)
    env: dict[str, str] = Field(default_factory=dict)


class AllocateRequest(BaseModel):
    task_key: str = Field(min_length=1, max_length=256)
    request_id: str | None = Field(None, max_length=256)


class LeaseRequest(BaseModel):
    lease_id: str = Field(min_length=1, max_length=128)


class ResetRequest(LeaseRequest):
    task_meta: TaskMeta
    run_ctx: dict[str, Any] | None = None  # OpenClaw-RL's run context (uid, indices): logged
    task_timeouts: dict[str, Any] | None = None  # `eval`: the checker's seconds; others ignored


class ToolCall(BaseModel):
    name: str = Field(min_length=1, max_length=128)
    # OpenAI sends arguments as a JSON string, OpenClaw-RL's client as an object: both are taken.
    arguments: dict[str, Any] | str | None = None


class ExecToolRequest(LeaseRequest):
    tool_call: ToolCall


class EvaluateRequest(LeaseRequest):
    checker: str | None = Field(None, description="overrides the reset's task_meta.checker")
    timeout_s: float | None = Field(None, gt=0)


def limits_of(task: TaskLimits, defaults: Limits, ceilings: Limits) -> Limits:
    """The task's limits over the defaults; SpecError naming any above its ceiling."""
    asked = task.model_dump(exclude_none=True)
    over = [
        f"{k}={v} (max {getattr(ceilings, k)})"
        for k, v in asked.items()
        if v > getattr(ceilings, k)
    ]
    if over:
        raise SpecError(f"task limits above this service's ceiling: {', '.join(over)}")
    return Limits(**{**defaults.__dict__, **asked})


def spec_of(task: TaskMeta, defaults: Limits, ceilings: Limits) -> SandboxSpec:
    """The sandbox a task needs (the checker is kept apart: the agent never sees it)."""
    return SandboxSpec(
        files=dict(task.files),
        tools=tuple(task.tools),
        limits=limits_of(task.limits, defaults, ceilings),
        env=dict(task.env),
        setup=task.setup,
    )


def user_message(task: TaskMeta) -> str:
    """The first user message of the episode, in OpenClaw-RL's words."""
    return f"Task name: {task.task_name}\nTask instruction: {task.instruction}"


def eval_timeout(task_timeouts: dict[str, Any] | None) -> float | None:
    """OpenClaw-RL's task_timeouts.eval when it is a positive number, else None."""
    raw = (task_timeouts or {}).get("eval")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None
