"""Fault injection on the whole loop: the judge, the trainer and the weight-sync launcher are
SIGKILLed (each whole process group, as a dying pod) under load and restarted 1-2 s later with
the same argv, beside a real Redis with AOF, the CPU engine on the tiny model and real gateway
replicas, all separate processes. Many simulated sessions talk through the gateways with the
official openai client meanwhile. Afterwards the run is reconciled from Redis and the trainer's
durable state (`tally`), and `problems` says what went wrong: a served main turn not recorded,
a turn without exactly one sample, a sample trained twice or never (beyond a partial batch),
dead letters, or gateways and engine not converged on the newest version.

Used by tests/integration/chaos/test_chaos.py (a small run in `make test`) and
tests/bench/bench_chaos.py (the full-size run over seeds in `make bench`)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import openai
import psutil
import redis

from clawrl.common.proto import control_pb2, control_pb2_grpc
from clawrl.common.proto.records_pb2 import MaskReason
from clawrl.common.records import Sample, Turn, decode_entry
from clawrl.common.shards import Shards
from clawrl.common.versions import VersionReady
from clawrl.trainer.samples import is_trainable
from tests.conftest import REPO, VENV_BIN, free_port, start_redis

MODEL = "smollm2-tiny"
TURNS, SAMPLES, DEAD = "clawrl:turns", "clawrl:samples", "clawrl:deadletter"
VERSIONS = "clawrl:versions"
UNFINISHED = f"{SAMPLES}:trainers:unfinished-steps"  # the trainer's steps in progress
JUDGE_CONSUMER = "chaos-judge"
KINDS = ("judge", "trainer", "launcher")
CHAOS_MARK = "CLAWRL_CHAOS_RUN"


@dataclass
class Plan:
    """One chaos run: the load, and how often each service is killed (the first kill of each
    waits until it is mid-work; then every other kill does, the rest come at a random time)."""

    seed: int = 0
    sessions: int = 24
    turns: int = 8
    concurrency: int = 6
    gateways: int = 2
    batch_size: int = 4
    judge_kills: int = 3
    trainer_kills: int = 3
    launcher_kills: int = 1
    think_s: tuple[float, float] = (0.2, 1.0)  # a user's pause between two turns
    gap_s: tuple[float, float] = (1.0, 4.0)  # between two kills
    settle_s: float = 180  # after the load, the longest wait for everything to converge
    work_wait_s: float = 120  # the longest wait for a service to be mid-work before a kill
    # Versions a sample may lag and still be trained: high, so that every trainable sample must
    # be trained (a restarting trainer falls far behind the load on this host).
    max_staleness: int = 200
    shards: int = 1  # redis.stream_shards: the data plane's streams split by session


class Service:
    """A process in a session of its own, so a kill takes its whole group (the trainer's Ray
    runtime too), as when a pod dies; restarted with the same argv and environment. Once
    supervised, one that exits by itself is restarted too (a pod's restartPolicy), and counted
    in `exits`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, ready):
        self.name, self.argv, self.env, self.ready = name, argv, env, ready
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.exits: list[int] = []  # exit codes of the runs that ended by themselves
        self.supervised = False
        self.down = False  # killed on purpose, not yet restarted
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            self._spawn()

    def _spawn(self) -> None:
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n==== start {self.starts}\n".encode())
            self.proc = subprocess.Popen(
                self.argv, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                cwd=REPO, start_new_session=True,
            )  # fmt: skip
        self.down = False

    def restart_if_exited(self) -> None:
        """Restart a run that ended by itself (a supervisor's job), 1 s later."""
        with self.lock:
            if self.down or self.proc is None or self.proc.poll() is None:
                return
            self.exits.append(self.proc.returncode)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its group
            time.sleep(1)  # under the lock: a kill meanwhile must not find it half-started
            self._spawn()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None and not self.supervised:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            with contextlib.suppress(OSError, httpx.HTTPError, grpc.RpcError):
                if self.ready():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout_s}s:\n{self.tail()}")
            time.sleep(0.2)

    def kill(self) -> None:
        with self.lock:
            self.down = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text)


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=1).status_code == 200


def gateway_status(control: str) -> control_pb2.GatewayStatus:
    with grpc.insecure_channel(control) as channel:
        stub = control_pb2_grpc.GatewayControlStub(channel)
        return stub.GetStatus(control_pb2.GetStatusRequest(), timeout=5)


def engine_version(url: str) -> str:
    return httpx.get(f"{url}/get_model_info", timeout=5).json()["weight_version"]


class Stack:
    """Redis (AOF), the engine, the gateways, the judge, the trainer and the launcher."""

    def __init__(self, workdir: Path, plan: Plan) -> None:
        self.workdir, self.plan = workdir, plan
        self.log_dir = workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = workdir / "checkpoints"
        port = free_port()
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        (workdir / "aof").mkdir(exist_ok=True)
        self.redis_child = start_redis(port, self.log_dir, aof_dir=workdir / "aof")
        self.redis = redis.Redis.from_url(self.redis_url, socket_timeout=10)
        self.services: dict[str, Service] = {}
        self.gateway_urls: list[str] = []
        self.controls: list[str] = []
        self._channels: list[grpc.Channel] = []
        shards = Shards(plan.shards)
        self.turns, self.samples = shards.names(TURNS), shards.names(SAMPLES)
        self.dead = shards.names(DEAD)
        common = {"CLAWRL_CONFIG": "/nonexistent/clawrl.toml", "CLAWRL_REDIS__URL": self.redis_url,
                  "CLAWRL_TRAIN__NUM_THREADS": "1",
                  "CLAWRL_REDIS__STREAM_SHARDS": str(plan.shards)}  # fmt: skip
        self.engine_url = self._add(
            "engine",
            [str(VENV_BIN / "clawrl-engine"), "--host", "127.0.0.1", "--model", MODEL,
             "--weight-version", "0", "--random-seed", str(plan.seed), "--torch-threads", "1"],
            common, "/health",
        )  # fmt: skip
        for i in range(plan.gateways):
            control = f"127.0.0.1:{free_port()}"
            url = self._add(
                f"gateway-{i}",
                [str(VENV_BIN / "clawrl-gateway"), "--host", "127.0.0.1", "--model", MODEL,
                 "--grpc-port", control.rsplit(":", 1)[1], "--engine-url", self.engine_url,
                 "--redis-url", self.redis_url],
                {**common, "CLAWRL_GATEWAY_ID": f"gateway-{i}"}, "/readyz",
            )  # fmt: skip
            self.gateway_urls.append(url)
            self.controls.append(control)
        judge_metrics = free_port()
        self.services["judge"] = Service(
            "judge",
            [str(VENV_BIN / "clawrl-judge"), "run", "--model", MODEL,
             "--consumer", JUDGE_CONSUMER, "--grpc-port", "0",
             "--metrics-port", str(judge_metrics)],
            # No judge engine: the reward plug-in alone (set before the flags are read). A dead
            # judge's turns are taken back within seconds, not the default minute.
            {**common, "CLAWRL_JUDGING__MODE": "rl",
             "CLAWRL_JUDGING__REWARD_FN": "tests.integration.chaos.plugins:slow_parity",
             "CLAWRL_BACKEND__ENGINE_URL": "", "CLAWRL_WORKERS__CLAIM_IDLE_MS": "1500",
             "PYTHONPATH": str(REPO)},
            self.log_dir,
            lambda: http_ok(f"http://127.0.0.1:{judge_metrics}/healthz"),
        )  # fmt: skip
        trainer_metrics = free_port()
        self.services["trainer"] = Service(
            "trainer",
            [str(VENV_BIN / "clawrl-trainer"), "--model", MODEL,
             "--checkpoint-dir", str(self.checkpoints), "--batch-size", str(plan.batch_size),
             "--sync-interval", "1", "--metrics-port", str(trainer_metrics)],
            # CHAOS_MARK: Ray's processes inherit it, so what a killed trainer left is found.
            {**common, "CLAWRL_CONSUMER__BLOCK_MS": "200", "CLAWRL_RAY__NUM_CPUS": "1",
             CHAOS_MARK: str(workdir),
             "CLAWRL_ROLLOUT__MAX_STALENESS": str(plan.max_staleness),
             "CLAWRL_CHECKPOINT__KEEP_VERSIONS": str(plan.max_staleness + 1)},
            self.log_dir,
            lambda: http_ok(f"http://127.0.0.1:{trainer_metrics}/metrics"),
        )  # fmt: skip
        launcher_metrics = free_port()
        self.services["launcher"] = Service(
            "launcher",
            [sys.executable, "-m", "clawrl.trainer.weight_sync.main",
             "--gateways", ",".join(self.controls), "--engines", self.engine_url,
             "watch", "--mode", "local", "--metrics-port", str(launcher_metrics)],
            # Short lease and lock: a killed sync's pause and lock run out within seconds.
            {**common, "CLAWRL_GATEWAYS__LEASE_S": "3", "CLAWRL_SYNC__LOCK_TTL_S": "8",
             "CLAWRL_LAUNCHER__RECONCILE_INTERVAL_S": "1",
             "CLAWRL_LAUNCHER__RETRY_BACKOFF_S": "0.5"},
            self.log_dir,
            lambda: http_ok(f"http://127.0.0.1:{launcher_metrics}/metrics"),
        )  # fmt: skip

    def _add(self, name: str, argv: list[str], env: dict[str, str], health: str) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.services[name] = Service(
            name, [*argv, "--port", str(port)], env, self.log_dir,
            lambda: http_ok(url + health),
        )  # fmt: skip
        return url

    def start(self, timeout_s: float = 300) -> None:
        """Everything at once (startup is the slow part), then each until it is ready."""
        for service in self.services.values():
            service.start()
        for service in self.services.values():
            service.wait_ready(timeout_s)
        self._channels = [grpc.insecure_channel(c) for c in self.controls]

    def stop(self) -> None:
        """Every service's group SIGKILLed, as the run's kills were: what was checked is in
        Redis and on disk already, and a killed trainer must leave no Ray process either."""
        for channel in self._channels:
            channel.close()
        for service in reversed(self.services.values()):
            if service.proc is not None:
                service.kill()
        self.redis.close()
        self.redis_child.stop()

    # ----- what the services are doing ---------------------------------------------------

    def busy(self, kind: str) -> str:
        """What `kind` is in the middle of now, "" when nothing: the judge holding turns, the
        trainer inside a step, the launcher's sync job running ("syncing") or holding the
        gateways paused ("paused")."""
        if kind == "judge":
            groups = [g for t in self.turns for g in stream_groups(self.redis, t)]
            return "judging" if any(g["pending"] for g in groups) else ""
        if kind == "trainer":
            return "step" if self.redis.hlen(UNFINISHED) else ""
        for channel in self._channels:
            stub = control_pb2_grpc.GatewayControlStub(channel)
            with contextlib.suppress(grpc.RpcError):
                status = stub.GetStatus(control_pb2.GetStatusRequest(), timeout=2)
                if status.holder.startswith("sync-"):
                    return "paused"
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.services["launcher"].proc.pid).children():
                if "--job-id" in child.cmdline():
                    return "syncing"
        return ""

    def versions(self) -> dict[str, object]:
        """The newest announced version and what the trainer, engine and gateways are on."""
        announced = self.redis.xrevrange(VERSIONS, count=1)
        state = trainer_state(self.checkpoints)
        out: dict[str, object] = {
            "announced": VersionReady.from_fields(announced[0][1]).version if announced else 0,
            "trainer": state["policy_version"] if state else 0,
        }
        with contextlib.suppress(OSError, httpx.HTTPError, KeyError):
            out["engine"] = engine_version(self.engine_url)
        for i, control in enumerate(self.controls):
            with contextlib.suppress(grpc.RpcError):
                status = gateway_status(control)
                out[f"gateway-{i}"] = "paused" if status.paused else status.policy_version
        return out


def marked_processes(workdir: Path) -> list[int]:
    """Processes started by this run's trainers (their environment carries the mark)."""
    mark = f"{CHAOS_MARK}={workdir}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
    return found


def stream_groups(r: redis.Redis, stream: str) -> list[dict]:
    """The stream's consumer groups; none while it does not exist (no session hashed to its
    shard yet)."""
    return r.xinfo_groups(stream) if r.exists(stream) else []


def trainer_state(checkpoints: Path) -> dict | None:
    pointer = checkpoints / "state" / "LATEST"
    if not pointer.is_file():
        return None
    return json.loads((checkpoints / "state" / pointer.read_text() / "trainer.json").read_text())


def converged(versions: dict[str, object]) -> bool:
    """Gateways, engine and trainer all on the newest announced version."""
    newest = versions["announced"]
    return all(str(v) == str(newest) for v in versions.values()) and len(versions) > 3


# ----- load ------------------------------------------------------------------------------


@dataclass
class Load:
    served: set[tuple[str, int]] = field(default_factory=set)  # (session id, main turn index)
    failures: Counter = field(default_factory=Counter)
    sessions: int = 0  # started
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_session(self, plan: Plan, chaos_done: threading.Event) -> int | None:
        """A new session's number: at least `plan.sessions`, and more while the kills go on
        (every kill must find load to interrupt)."""
        with self.lock:
            if self.sessions >= plan.sessions and chaos_done.is_set():
                return None
            self.sessions += 1
            return self.sessions - 1


def talk(stack: Stack, plan: Plan, session: int, load: Load) -> None:
    """One user: `plan.turns` main turns in one session, its replicas taken in turn; the last
    request closes the session (X-Session-Done), which finalises its last turn."""
    rng = random.Random(f"{plan.seed}-{session}")
    sid = f"chaos{plan.seed}-s{session:03d}"
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    for index in range(plan.turns):
        thing = rng.choice(("fruit", "colour", "city", "river", "tree"))
        messages.append({"role": "user", "content": f"Question {index}: name a {thing}."})
        headers = {"X-Session-Id": sid, "X-Turn-Type": "main"}
        if index == plan.turns - 1:
            headers["X-Session-Done"] = "true"
        url = stack.gateway_urls[(session + index) % len(stack.gateway_urls)]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="chaos", max_retries=0, timeout=600)
        for attempt in range(5):
            try:
                reply = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=rng.randint(3, 10),
                    temperature=1.0, extra_headers=headers,
                )  # fmt: skip
                break
            except (openai.APIConnectionError, openai.APIStatusError) as exc:
                # Not served (a pause held it past its limit): asked again, as a client would.
                with load.lock:
                    load.failures[type(exc).__name__] += 1
                time.sleep(1 + attempt)
        else:
            return  # the session ends here; its served turns must still be recorded
        with load.lock:
            load.served.add((sid, index))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        time.sleep(rng.uniform(*plan.think_s))


def drive(stack: Stack, plan: Plan, chaos_done: threading.Event) -> Load:
    load = Load()

    def user() -> None:
        while (session := load.next_session(plan, chaos_done)) is not None:
            talk(stack, plan, session, load)

    with ThreadPoolExecutor(plan.concurrency) as pool:
        for future in [pool.submit(user) for _ in range(plan.concurrency)]:
            future.result()
    return load


# ----- chaos -----------------------------------------------------------------------------


@dataclass
class Kill:
    kind: str
    at_s: float
    mid_work: str  # what it was doing (Stack.busy), "" when idle


def schedule(plan: Plan) -> list[str]:
    """The order of the kills: every kind spread over the run, reproducible per seed."""
    kinds = (["judge"] * plan.judge_kills + ["trainer"] * plan.trainer_kills
             + ["launcher"] * plan.launcher_kills)  # fmt: skip
    random.Random(plan.seed).shuffle(kinds)
    return kinds


def inject(stack: Stack, plan: Plan, done: threading.Event, kills: list[Kill]) -> None:
    """Kill each scheduled service and restart it 1-2 s later with the same argv. A kill that
    should find its service mid-work waits (up to `plan.work_wait_s`) until it is."""
    rng = random.Random(plan.seed + 1)
    started = time.monotonic()
    seen: Counter = Counter()
    for kind in schedule(plan):
        time.sleep(rng.uniform(*plan.gap_s))
        service = stack.services[kind]
        # The first kill of each kind, then every other one, waits for work in progress.
        wants_work = seen[kind] % 2 == 0
        seen[kind] += 1
        doing = ""
        if wants_work:
            service.wait_ready(300)  # a restarted trainer needs its Ray runtime first
            # The launcher: best while its sync holds the gateways paused, else mid-sync.
            best = "paused" if kind == "launcher" else None
            deadline = time.monotonic() + plan.work_wait_s
            while time.monotonic() < deadline:
                doing = stack.busy(kind)
                late = time.monotonic() > deadline - plan.work_wait_s / 2
                if doing and (doing == best or best is None or late):
                    break
                time.sleep(0.005)
        service.kill()
        kills.append(Kill(kind, time.monotonic() - started, doing if wants_work else ""))
        time.sleep(rng.uniform(1.0, 2.0))
        service.start()
    done.set()


# ----- reconciliation --------------------------------------------------------------------


DROPPED = re.compile(r"dropped sample (\S+) \((\w+), policy version")


def trainer_drops(log_path: Path) -> dict[str, str]:
    """Sample id -> why the trainer dropped it (its log, over all its runs)."""
    return dict(DROPPED.findall(log_path.read_text(errors="replace")))


RETRACTED = re.compile(r"(\d+) generation\(s\) retracted")


def retracted(log_path: Path) -> int:
    """Generations the syncs retracted (the launcher's log holds its jobs' output)."""
    return sum(int(n) for n in RETRACTED.findall(log_path.read_text(errors="replace")))


def tally(stack: Stack, plan: Plan, load: Load, kills: list[Kill]) -> dict[str, object]:
    """Everything the run must account for, from Redis and the trainer's durable state."""
    r = stack.redis
    turns = [decode_entry(f, Turn) for stream in stack.turns for _, f in r.xrange(stream)]
    # (shard, entry id) -> sample
    entries = {(k, e): decode_entry(f, Sample) for k, stream in enumerate(stack.samples)
               for e, f in r.xrange(stream)}  # fmt: skip
    samples = list(entries.values())
    recorded = {(t.session_id, t.turn_index) for t in turns}
    turn_ids = Counter(t.turn_id for t in turns)
    sample_ids = Counter(s.sample_id for s in samples)
    trainable = {s.sample_id for s in samples if is_trainable(s)}
    state = trainer_state(stack.checkpoints) or {"samples_trained": 0, "trained_ids": []}
    trained = set(state["trained_ids"])
    pending = {(k, e["message_id"]) for k, stream in enumerate(stack.samples)
               if stream_groups(r, stream)
               for e in r.xpending_range(stream, "trainers", "-", "+", 100_000)}  # fmt: skip
    drops = trainer_drops(stack.services["trainer"].log_path)
    dropped = {i: drops[i] for i in trainable - trained if i in drops}
    waiting_entries = {e: s for e, s in entries.items()
                       if s.sample_id in trainable - trained - set(dropped)}  # fmt: skip
    dead = [{k.decode(): v.decode(errors="replace")[:200] for k, v in f.items() if k != b"data"}
            for stream in stack.dead for _, f in r.xrange(stream)]  # fmt: skip
    masked = Counter(MaskReason.Name(s.mask_reason) for s in samples if s.mask_reason)
    return {
        "served": len(load.served),
        "client_failures": dict(load.failures),
        "recorded": len(recorded & load.served),
        "not_recorded": sorted(load.served - recorded),
        "turn_entries": len(turns),
        "turns": len(turn_ids),
        "samples": len(samples),
        "duplicate_samples": sum(n - 1 for n in sample_ids.values()),
        "turns_without_sample": sorted(set(turn_ids) - set(sample_ids)),
        "samples_without_turn": sorted(set(sample_ids) - set(turn_ids)),
        "trainable": len(trainable),
        "masked": dict(masked),
        "retracted": retracted(stack.services["launcher"].log_path),
        "trained": state["samples_trained"],
        "trained_distinct": len(trained),
        "trained_twice": state["samples_trained"] - len(trained),
        "trained_not_trainable": sorted(trained - trainable),
        # Trainable, untrained: dropped with a reason (more than max_staleness versions old)...
        "dropped": dict(Counter(dropped.values())),
        # ...or waiting for a batch to fill (pending on the trainer).
        "waiting": len(waiting_entries),
        "waiting_not_pending": sorted(
            waiting_entries[e].sample_id for e in waiting_entries if e not in pending
        ),
        "dead_letters": dead,
        "steps": state.get("step", 0),
        "versions": stack.versions(),
        "kills": {k: sum(1 for x in kills if x.kind == k) for k in KINDS},
        "kills_mid_work": {k: sum(1 for x in kills if x.kind == k and x.mid_work) for k in KINDS},
        "kills_log": [f"{x.at_s:.1f}s {x.kind} ({x.mid_work or 'idle'})" for x in kills],
        # Runs that ended by themselves (restarted like a pod): not a defect in itself, the
        # checks above say whether anything was lost; a crash loop shows here.
        "exits": {n: s.exits for n, s in stack.services.items() if s.exits},
    }


def problems(t: dict[str, object], plan: Plan) -> list[str]:
    """What the tallies show went wrong; empty when the run is sound."""
    found = []
    if t["recorded"] != t["served"]:
        found.append(f"{t['served'] - t['recorded']} served turns not recorded: "
                     f"{t['not_recorded'][:5]}")  # fmt: skip
    for key in ("turns_without_sample", "samples_without_turn", "trained_not_trainable",
                "waiting_not_pending", "dead_letters"):  # fmt: skip
        if t[key]:
            found.append(f"{key}: {t[key][:5]}")
    # A turn is masked as mixed-policy only when a sync really retracted its generation (no
    # engine restarts here, so none served weights of no known version).
    off_policy = sum(
        t["masked"].get(f"MASK_REASON_{r}", 0) for r in ("MIXED_POLICY", "UNKNOWN_VERSION")
    )
    if off_policy > t["retracted"]:
        found.append(f"{off_policy} turns masked as mixed-policy or unknown-version, "
                     f"{t['retracted']} generations retracted: {t['masked']}")  # fmt: skip
    for key in ("duplicate_samples", "trained_twice"):
        if t[key]:
            found.append(f"{key}: {t[key]}")
    dropped = sum(t["dropped"].values())
    if t["trained_distinct"] + dropped + t["waiting"] != t["trainable"]:
        found.append(f"trainable {t['trainable']} != trained {t['trained_distinct']} + dropped "
                     f"{dropped} + waiting {t['waiting']}")  # fmt: skip
    if set(t["dropped"]) - {"stale"}:
        found.append(f"dropped for other reasons than staleness: {t['dropped']}")
    if t["waiting"] >= plan.batch_size:
        found.append(f"{t['waiting']} trainable samples stranded (a batch is {plan.batch_size})")
    if t.get("trainer_processes_left"):
        found.append(f"{t['trainer_processes_left']} trainer (Ray) processes left after the stop")
    if not converged(t["versions"]):
        found.append(f"versions not converged: {t['versions']}")
    wanted = {"judge": plan.judge_kills, "trainer": plan.trainer_kills,
              "launcher": plan.launcher_kills}  # fmt: skip
    if t["kills"] != wanted:
        found.append(f"kills {t['kills']} != planned {wanted}")
    missed = [k for k in KINDS if wanted[k] and not t["kills_mid_work"][k]]
    if missed:
        found.append(f"never killed mid-work: {missed}")
    return found


def settle(stack: Stack, plan: Plan) -> None:
    """Until every turn is judged, the trainer has taken what fills a batch, and the versions
    agree (or `plan.settle_s` passes: the tallies then show what is stuck)."""
    deadline = time.monotonic() + plan.settle_s
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError):
            r = stack.redis
            judged = all(
                not g["pending"] and not g["lag"] for t in stack.turns for g in stream_groups(r, t)
            )
            samples_read = all(not g["lag"] for s in stack.samples for g in stream_groups(r, s))
            if judged and samples_read and not stack.redis.hlen(UNFINISHED):
                if converged(stack.versions()):
                    return
        time.sleep(0.5)


def supervise(stack: Stack, stopping: threading.Event) -> None:
    """Restart what exits by itself until `stopping` (a Ray runtime that timed out starting on
    an overloaded host ended a run otherwise)."""
    while not stopping.wait(0.5):
        for service in stack.services.values():
            service.restart_if_exited()


def run(workdir: Path, plan: Plan) -> tuple[dict[str, object], list[str]]:
    """One chaos run: start the stack, load it while killing, settle, reconcile."""
    stack = Stack(workdir, plan)
    kills: list[Kill] = []
    done, stopping = threading.Event(), threading.Event()
    chaos = threading.Thread(target=inject, args=(stack, plan, done, kills), daemon=True)
    supervisor = threading.Thread(target=supervise, args=(stack, stopping), daemon=True)
    for service in stack.services.values():
        service.supervised = True
    try:
        supervisor.start()  # from the start: a Ray runtime may time out starting on a busy host
        stack.start()
        chaos.start()
        load = drive(stack, plan, done)
        chaos.join()
        for service in stack.services.values():
            service.wait_ready(300)
        settle(stack, plan)
        t = tally(stack, plan, load, kills)
    finally:
        stopping.set()
        if supervisor.is_alive():
            supervisor.join()
        stack.stop()
    # Every trainer was killed or stopped: what any of them started must be gone too.
    deadline = time.monotonic() + 10
    while (left := marked_processes(workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    t["trainer_processes_left"] = len(left)
    return t, problems(t, plan)
