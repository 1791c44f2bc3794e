"""Crash and resume of the real `clawrl-trainer` process (local Ray runtime, real Redis, tiny
model): killed between a step's durable state and its XACK, a restarted trainer trains every
sample exactly once and loses none."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from clawrl.common.versions import VersionReady
from tests.conftest import VENV_BIN, free_port

from .helpers import make_sample, publish_all, settings_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class TrainerProcess:
    """`clawrl-trainer` in its own process group, so a kill takes its Ray runtime with it,
    as when a pod dies."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.metrics_port = free_port()
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "clawrl-trainer"), "--metrics-port", str(self.metrics_port)],
            env={**os.environ, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}")
        for line in text.splitlines():
            if line.startswith(wanted if labels else name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{wanted} not exported")

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """SIGKILL: the whole group at once (a dying pod); SIGTERM: the trainer alone, then
        whatever of its Ray runtime is left."""
        if sig == signal.SIGKILL:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return code

    def niceness_of(self, title: str) -> list[int]:
        """The niceness of each process this trainer started (its environment, which Ray's
        processes inherit) whose title starts with `title` (Ray names an actor's process
        `ray::Class` or `ray::Class.method`)."""
        marker = f"CLAWRL_CHECKPOINT__DIR={self.env['CLAWRL_CHECKPOINT__DIR']}".encode()
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                    continue
                if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(os.getpriority(os.PRIO_PROCESS, int(pid)))
        return found

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            if self.proc.poll() is not None:
                raise AssertionError(f"trainer exited ({self.proc.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {timeout_s}s:\n{self.log()[-3000:]}")
            time.sleep(0.2)


def env_of(settings) -> dict[str, str]:
    r, c = settings.redis, settings.checkpoint
    return {
        "CLAWRL_MODEL__PATH": "smollm2-tiny",
        "CLAWRL_REDIS__URL": r.url,
        "CLAWRL_REDIS__SAMPLES_STREAM": r.samples_stream,
        "CLAWRL_REDIS__DEADLETTER_STREAM": r.deadletter_stream,
        "CLAWRL_REDIS__VERSIONS_STREAM": r.versions_stream,
        "CLAWRL_ROLLOUT__ROLLOUT_BATCH_SIZE": str(settings.rollout.rollout_batch_size),
        "CLAWRL_CONSUMER__BLOCK_MS": "200",
        "CLAWRL_CHECKPOINT__DIR": str(c.dir),
        "CLAWRL_RAY__NUM_CPUS": "2",
    }


def latest_state(checkpoint_dir: Path) -> dict | None:
    pointer = checkpoint_dir / "state" / "LATEST"
    if not pointer.is_file():
        return None
    return json.loads((checkpoint_dir / "state" / pointer.read_text() / "trainer.json").read_text())


async def pending(redis: Redis, settings) -> int:
    return int((await redis.xpending(settings.redis.samples_stream, "trainers"))["pending"])


async def test_kill_between_step_and_xack_then_resume(redis_url, tmp_path) -> None:
    redis = Redis.from_url(redis_url)
    settings = settings_for(redis_url, tmp_path / "ck", rollout={"rollout_batch_size": 2})
    ids = [f"crash{uuid.uuid4().hex[:4]}-{i}:0" for i in range(6)]
    await publish_all(
        redis, settings, [make_sample(sid, [60 + i, 61]) for i, sid in enumerate(ids)]
    )

    first = TrainerProcess(
        {**env_of(settings), "CLAWRL_CHECKPOINT__HOLD_BEFORE_ACK_STEP": "2"},
        tmp_path / "first.log",
    )
    try:
        first.wait_for("holding before XACK of step 2", timeout_s=240)
        assert latest_state(tmp_path / "ck")["step"] == 2  # durable...
        assert await pending(redis, settings) == 2  # ...but step 2's entries not acknowledged
        # The training actor runs at the trainer's own priority (Ray's default niceness of 15
        # starved it beside busy engines).
        trainer_niceness = os.getpriority(os.PRIO_PROCESS, first.proc.pid)
        assert first.niceness_of("ray::TorchBackend") == [trainer_niceness]
    finally:
        first.kill(signal.SIGKILL)

    second = TrainerProcess(env_of(settings), tmp_path / "second.log")
    try:
        second.wait_for("step 3:", timeout_s=240)
        for _ in range(50):
            if await pending(redis, settings) == 0:
                break
            await asyncio.sleep(0.1)
        state = latest_state(tmp_path / "ck")
        assert state["step"] == 3
        assert state["samples_trained"] == 6  # 2 + 2 before the kill, 2 after: none twice
        assert sorted(state["trained_ids"]) == sorted(ids)  # none lost
        assert await pending(redis, settings) == 0
        assert second.metric("clawrl_trainer_samples_dropped_total", reason="duplicate") == 2
        assert "step 1:" not in second.log() and "step 2:" not in second.log()
        versions = [
            VersionReady.from_fields(f).version
            for _, f in await redis.xrange(settings.redis.versions_stream)
        ]
        assert versions == [1, 2, 3]  # v2's announcement, lost in the kill, is made on resume
        assert second.kill(signal.SIGTERM) == 0  # a graceful stop exits cleanly
    finally:
        if second.proc.poll() is None:
            second.kill(signal.SIGKILL)
        await redis.aclose()
