"""The weight-sync job against two real gateway replicas and the CPU engine: the pause happens,
the version changes everywhere, requests sent meanwhile all succeed; a failing update leaves
every gateway resumed on the old version (and an engine that did load is rolled back); a job
killed with SIGKILL after Pause leaves no gateway paused past its lease, and its lock keeps a
second sync out until the lock's TTL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
import uuid

import httpx
import pytest
import redis

from clawrl.common.records import Turn, decode_entry
from clawrl.common.versions import VersionReady, announce
from clawrl.trainer.weight_sync.job import SyncResult, sync_version
from clawrl.trainer.weight_sync.launcher import SyncWatcher
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.settings import WeightSyncSettings
from tests.conftest import wait_until

from .conftest import run_sync, sync_argv

pytestmark = pytest.mark.integration


def engine_weights(url: str) -> tuple[str, list[float]]:
    """The engine's weight_version and its greedy log-probs on a fixed prompt (a fingerprint
    of the weights it serves)."""
    version = httpx.get(f"{url}/get_model_info", timeout=10).json()["weight_version"]
    reply = httpx.post(
        f"{url}/generate",
        json={"input_ids": [1, 2, 3, 4, 5], "return_logprob": True,
              "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        timeout=60,
    ).json()  # fmt: skip
    return version, [round(lp, 4) for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]


def announce_version(redis_url: str, stream: str, version: int, path) -> None:
    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        await announce(client, stream, VersionReady(version, str(path), version, time.time()))
        await client.aclose()

    asyncio.run(go())


def results(redis_url: str, stream: str) -> list[SyncResult]:
    client = redis.Redis.from_url(redis_url)
    return [SyncResult.from_fields(fields) for _, fields in client.xrange(stream)]


class Load:
    """Clients sending requests to every replica until stopped; every answer is kept."""

    def __init__(self, replicas, clients_per_replica: int = 2):
        self.stop = threading.Event()
        self.answers: list[tuple[int, str]] = []
        self.threads = [
            threading.Thread(target=self._loop, args=(r,))
            for r in replicas
            for _ in range(clients_per_replica)
        ]

    def _loop(self, replica):
        while not self.stop.is_set():
            reply = replica.chat("hello")
            body = reply.json()
            self.answers.append((reply.status_code, body.get("system_fingerprint", str(body))))

    def wait_answer(self, fingerprint: str | None = None, timeout_s: float = 120) -> None:
        """Until an answer comes back after this call (from `fingerprint`'s weights, if given):
        no fixed sleep, which a loaded host may outlast and an idle one need not wait."""
        seen = len(self.answers)
        what = f"an answer from {fingerprint}" if fingerprint else "an answer"
        wait_until(lambda: any(fingerprint in (None, answer[-1]) and answer[0] == 200
                               for answer in self.answers[seen:]), timeout_s, what)  # fmt: skip

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def test_sync_pauses_loads_everywhere_and_resumes_with_the_new_version(
    replicas, engine, checkpoints, sync_env, redis_url
):
    before_version, before = engine_weights(engine)
    # Known gateway issue (reported, not this test's subject): the first request after the
    # gateway sat idle longer than the engine's keep-alive can fail on a stale connection.
    for replica in replicas:
        replica.chat("warm up")
    announce_version(redis_url, sync_env["CLAWRL_REDIS__VERSIONS_STREAM"], 1, checkpoints["v1"])
    pauses = [r.metric("clawrl_gateway_pauses_total") for r in replicas]
    with Load(replicas) as load:
        load.wait_answer()  # traffic flowing before the sync
        done = run_sync(sync_env, replicas, [engine], "run", "--version", "1", "--path",
                        str(checkpoints["v1"]), "--job-id", "job-ok")  # fmt: skip
        load.wait_answer("clawrl-policy-v1")  # and after it
    assert done.returncode == 0, done.stderr
    # One pause on each replica, held by this job (counted and logged by the gateway: a pause
    # can be over before a poller sees it).
    for replica, before_pauses in zip(replicas, pauses, strict=True):
        assert replica.metric("clawrl_gateway_pauses_total") == before_pauses + 1
        assert "pause requested by job-ok" in replica.child.log_path.read_text()
    # The version changed everywhere: both gateways and the engine, whose outputs changed.
    for replica in replicas:
        status = replica.status()
        assert (status.paused, status.policy_version, status.holder) == (False, 1, "")
        after = replica.chat("hi")
        assert after.json()["system_fingerprint"] == "clawrl-policy-v1"
    version, logprobs = engine_weights(engine)
    # The engine is shared by the weight-sync modules (one process per engine key): whatever
    # an earlier module left it on, it serves v1 now, and other outputs than before.
    assert before_version != "1" and version == "1"
    assert logprobs != before
    # Every request sent during the sync succeeded; later ones carry v1.
    assert load.answers and all(code == 200 for code, _ in load.answers)
    assert load.answers[-1][1] == "clawrl-policy-v1"
    [result] = results(redis_url, sync_env["CLAWRL_SYNC__RESULTS_STREAM"])
    assert (result.version, result.outcome, result.gateways, result.engines) == (1, "ok", 2, 1)
    assert 0 < result.load_s <= result.pause_s
    assert "weight sync to v1: ok" in done.stderr and "pause " in done.stderr
    # Again: the engines already serve v1, nothing is paused.
    again = run_sync(sync_env, replicas, [engine], "run", "--version", "1", "--path",
                     str(checkpoints["v1"]))  # fmt: skip
    assert again.returncode == 0
    assert results(redis_url, sync_env["CLAWRL_SYNC__RESULTS_STREAM"])[-1].outcome == "skipped"


def test_failing_update_resumes_every_gateway_on_the_old_version(
    replicas, engine, tmp_path, sync_env, redis_url
):
    versions = [r.status().policy_version for r in replicas]
    served = engine_weights(engine)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    with Load(replicas, clients_per_replica=1) as load:
        done = run_sync(sync_env, replicas, [engine], "run", "--version", "7", "--path",
                        str(broken))  # fmt: skip
    assert done.returncode == 1
    assert "weight sync to v7: failed" in done.stderr and str(broken) in done.stderr
    for replica, version in zip(replicas, versions, strict=True):
        status = replica.status()
        assert (status.paused, status.policy_version) == (False, version)
    assert engine_weights(engine) == served
    assert all(code == 200 for code, _ in load.answers)
    [result] = results(redis_url, sync_env["CLAWRL_SYNC__RESULTS_STREAM"])
    assert result.outcome == "failed" and "cannot load weights" in result.reason


def test_an_engine_that_loaded_is_rolled_back_when_another_fails(
    replicas, engine, one_layer_engine, checkpoints, sync_env, redis_url
):
    versions = [r.status().policy_version for r in replicas]
    served = engine_weights(engine)
    # As the trainer would have: the version the engine serves was announced with its path
    # (version 0 is the engine's initial model, which it reports itself).
    if served[0] != "0":
        stream = sync_env["CLAWRL_REDIS__VERSIONS_STREAM"]
        announce_version(redis_url, stream, int(served[0]), checkpoints[f"v{served[0]}"])
    done = run_sync(sync_env, replicas, [engine, one_layer_engine],
                    "run", "--version", "2", "--path", str(checkpoints["v2"]))  # fmt: skip
    assert done.returncode == 1, done.stderr
    [result] = results(redis_url, sync_env["CLAWRL_SYNC__RESULTS_STREAM"])
    assert result.outcome == "failed"
    assert "unknown tensors" in result.reason and "rolled 1 updated engine(s) back" in result.reason
    # The engine that had loaded v2 serves its old weights again, under its old version.
    assert engine_weights(engine) == served
    assert [r.status().policy_version for r in replicas] == versions
    assert not any(r.status().paused for r in replicas)


def test_sigkill_after_pause_leaves_no_gateway_paused_past_the_lease(replicas, sync_env, tmp_path):
    # An engine that says what it serves, then never finishes loading: the job is mid-sync.
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Hanging(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"weight_version": "0", "model_path": "/m"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            time.sleep(60)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hanging)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hanging = f"http://127.0.0.1:{server.server_address[1]}"
    lease_s = 3.0  # renewed every 1 s: seconds of slack for a job slowed by a loaded host
    env = {**sync_env, "CLAWRL_SYNC__LOCK_TTL_S": "60", "CLAWRL_GATEWAYS__LEASE_S": str(lease_s)}
    expiries = [r.metric("clawrl_gateway_pause_lease_expiries_total") for r in replicas]
    job_log = tmp_path / "job.log"
    job = subprocess.Popen(
        sync_argv(replicas, [hanging], "run", "--version", "3",
                  "--path", "/nowhere", "--job-id", "job-killed"),
        env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=job_log.open("w"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not all(r.status().holder == "job-killed" for r in replicas):
            assert time.monotonic() < deadline and job.poll() is None, job_log.read_text()
            time.sleep(0.02)
        # Renewals keep the pause past one lease while the job lives.
        time.sleep(lease_s + 0.5)
        assert all(r.status().paused for r in replicas)
        job.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait()
        # Slack for a loaded host, still far short of the gateways' default lease (30 s).
        while any(r.status().paused for r in replicas):
            assert time.monotonic() - killed_at < lease_s + 10.0, "a gateway stayed paused"
            time.sleep(0.02)
        # The dead job's lock outlives it (until its TTL): a second sync is kept out.
        busy = run_sync(env, replicas, [hanging], "run", "--version", "3", "--path", "/nowhere")
        assert busy.returncode == 2 and "job-killed" in busy.stderr
        for replica, before in zip(replicas, expiries, strict=True):
            assert replica.metric("clawrl_gateway_pause_lease_expiries_total") == before + 1
            assert replica.chat("back").status_code == 200
    finally:
        job.kill()
        server.shutdown()


def tokens_for(engine: str, seconds: float) -> int:
    """How many tokens the engine decodes in about `seconds` now (the host's load varies)."""
    started = time.monotonic()
    httpx.post(
        f"{engine}/generate",
        json={"text": "Count.", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}},
        timeout=120,
    ).raise_for_status()
    return int(min(2000, max(32, 16 / (time.monotonic() - started) * seconds)))


class LongGeneration(threading.Thread):
    """One main turn (a session of its own, done with this turn) generating `tokens` tokens
    through a gateway (greedy: the random model loops on one token, never its end of text);
    keeps the answer."""

    def __init__(self, replica, tokens: int, stream: bool = False):
        super().__init__(daemon=True)
        self.replica, self.tokens, self.stream = replica, tokens, stream
        self.session = f"long-{uuid.uuid4().hex[:8]}"
        self.reply: httpx.Response | None = None

    def run(self):
        streaming = {"stream": True, "stream_options": {"include_usage": True}}
        self.reply = httpx.post(
            f"{self.replica.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Tell me a long story."}],
                  "max_tokens": self.tokens, "temperature": 0,
                  **(streaming if self.stream else {})},
            headers={"X-Session-Id": self.session, "X-Session-Done": "true"},
            timeout=600,
        )  # fmt: skip

    def answer(self) -> tuple[int, list[str]]:
        """(completion tokens, the system fingerprints it carried in order, repeats left out),
        streamed or not."""
        assert self.reply is not None and self.reply.status_code == 200, self.reply
        if not self.stream:
            body = self.reply.json()
            return body["usage"]["completion_tokens"], [body["system_fingerprint"]]
        chunks = [
            json.loads(line.removeprefix("data: "))
            for line in self.reply.text.splitlines()
            if line.startswith("data: {")
        ]
        assert self.reply.text.rstrip().endswith("data: [DONE]")
        usage = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
        fingerprints = list(dict.fromkeys(chunk["system_fingerprint"] for chunk in chunks))
        return usage[-1]["completion_tokens"], fingerprints

    def started(self) -> None:
        """Returns once the generation runs (the gateway counts it in flight)."""
        self.start()
        deadline = time.monotonic() + 60
        while self.replica.status().in_flight < 1:
            assert time.monotonic() < deadline and self.is_alive(), (
                f"the generation never ran: {self.reply and self.reply.text}"
            )
            time.sleep(0.01)
        time.sleep(0.5)  # into its tokens

    def turn(self, redis_url: str) -> Turn:
        """The turn the gateway recorded for it."""
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for _, fields in client.xrange("clawrl:turns"):
                turn = decode_entry(fields, Turn)
                if turn.session_id == self.session:
                    return turn
            time.sleep(0.1)
        raise AssertionError(f"no turn recorded for {self.session}")


BUDGET_S = 0.25  # the drain budget of these syncs


def sync_in_process(sync_env, replicas, engines, version: int, path) -> SyncResult:
    """One sync run here (no process start, so the generation it meets is surely running)."""
    settings = WeightSyncSettings(
        redis={"url": sync_env["CLAWRL_REDIS__URL"],
               "versions_stream": sync_env["CLAWRL_REDIS__VERSIONS_STREAM"]},
        gateways={"addresses": [r.control for r in replicas], "drain_timeout_s": BUDGET_S},
        engines={"urls": engines},
        sync={"lock_key": sync_env["CLAWRL_SYNC__LOCK_KEY"],
              "results_stream": sync_env["CLAWRL_SYNC__RESULTS_STREAM"]},
    )  # fmt: skip

    async def go():
        client = redis.asyncio.Redis.from_url(settings.redis.url)
        try:
            ready = VersionReady(version, str(path), version, time.time())
            return await sync_version(settings, client, ready, f"job-{uuid.uuid4().hex[:6]}")
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_sync_retracts_a_long_generation_which_completes_on_the_new_weights(
    replicas, engine, checkpoints, sync_env, redis_url, stream
):
    """The pause ends within the drain budget + the load, not after the generation; the
    generation completes, continued on the new weights, and its turn records both versions."""
    old = int(engine_weights(engine)[0])
    new = old + (20 if stream else 10)
    long = LongGeneration(replicas[0], tokens_for(engine, 8.0), stream=stream)
    long.started()
    result = sync_in_process(sync_env, replicas, [engine], new, checkpoints["v2"])
    assert long.is_alive(), "the generation ended before the sync: it proves nothing"
    assert result.outcome == "ok" and result.retracted == 1, result
    # Margins for a loaded host; that the pause did not wait for the generation is shown by
    # the generation still running after the sync.
    assert BUDGET_S <= result.drain_s < BUDGET_S + 3.0, result
    assert result.pause_s < result.drain_s + result.load_s + 5.0, result
    assert "1 generation(s) retracted" in result.summary()
    long.join(timeout=600)
    # A whole reply names the version that finished it; a stream's chunks name the weights of
    # their tokens: the old ones up to the sync, the new ones after it.
    expected = [f"clawrl-policy-v{v}" for v in ((old, new) if stream else (new,))]
    assert long.answer() == (long.tokens, expected)
    turn = long.turn(redis_url)
    assert turn.HasField("admitted_policy_version")
    assert (turn.admitted_policy_version, turn.policy_version, turn.weight_version) == (
        old,
        new,
        str(new),
    )
    assert len(turn.response_ids) == len(turn.response_logprobs) == long.tokens
    for replica in replicas:
        status = replica.status()
        assert (status.paused, status.policy_version) == (False, new)


def test_a_failing_load_after_a_retract_still_continues_the_engines(
    replicas, engine, tmp_path, sync_env, redis_url
):
    """The engines were paused for the load; the load fails; /continue_generation is sent all
    the same: the retracted generation completes on the old weights, new requests are served."""
    served = engine_weights(engine)
    old = int(served[0])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    long = LongGeneration(replicas[1], tokens_for(engine, 8.0))
    long.started()
    result = sync_in_process(sync_env, replicas, [engine], old + 1, broken)
    assert long.is_alive(), "the generation ended before the sync: it proves nothing"
    assert result.outcome == "failed" and "cannot load weights" in result.reason, result
    # Continued: without /continue_generation the engine would hold both of these forever.
    long.join(timeout=600)
    assert long.reply is not None and long.reply.status_code == 200, long.reply
    assert long.reply.json()["usage"]["completion_tokens"] == long.tokens
    assert replicas[0].chat("after").status_code == 200
    turn = long.turn(redis_url)
    assert (turn.admitted_policy_version, turn.policy_version) == (old, old)
    assert engine_weights(engine) == served
    assert not any(r.status().paused for r in replicas)


def held_by_a_paused_engine(engine: str) -> tuple[threading.Thread, list[httpx.Response]]:
    """The engine paused as a retracting sync leaves it, and a generation it holds: the thread
    sending it and where its reply will land."""
    httpx.post(f"{engine}/pause_generation", json={"mode": "retract"}, timeout=10)
    held: list[httpx.Response] = []
    generation = threading.Thread(
        target=lambda: held.append(httpx.post(
            f"{engine}/generate",
            json={"text": "Paused?", "sampling_params": {"max_new_tokens": 4}},
            timeout=120,
        )),
        daemon=True,
    )  # fmt: skip
    generation.start()
    generation.join(timeout=1.0)
    assert generation.is_alive(), "the paused engine answered"
    return generation, held


def test_the_launcher_continues_the_engines_after_a_sync_that_died_retracting(
    engine, sync_env, redis_url
):
    """A job killed between /pause_generation and /continue_generation leaves the engine
    paused; the launcher, seeing the job end without a result, continues every engine."""
    generation, held = held_by_a_paused_engine(engine)
    settings = WeightSyncSettings(
        redis={"url": redis_url, "versions_stream": sync_env["CLAWRL_REDIS__VERSIONS_STREAM"]},
        engines={"urls": [engine]},
        sync={"results_stream": sync_env["CLAWRL_SYNC__RESULTS_STREAM"]},
        launcher={"max_attempts": 1},
    )
    metrics = WeightSyncMetrics()

    async def killed(ready: VersionReady) -> int:
        return -signal.SIGKILL  # no result published: the job died

    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            watcher = SyncWatcher(settings, client, killed, metrics, block_ms=50)
            await watcher._sync(VersionReady(99, "/nowhere", 99, time.time()))
        finally:
            await client.aclose()

    try:
        asyncio.run(go())
        generation.join(timeout=60)
        assert held and held[0].status_code == 200, held
    finally:
        httpx.post(f"{engine}/continue_generation", json={}, timeout=10)
    value = metrics.registry.get_sample_value
    assert value("clawrl_weight_sync_syncs_total", {"outcome": "crashed"}) == 1
    assert value("clawrl_weight_sync_continue_failures_total") == 0


@pytest.mark.parametrize("sync_running", [False, True], ids=["lock free", "lock held"])
def test_a_starting_launcher_continues_engines_a_dead_launcher_left_paused(
    engine, sync_env, redis_url, sync_running
):
    """The job and its launcher both died with the engine paused (retract): a launcher that
    starts continues it, unless a sync holds the lock (that sync continues its engines)."""
    lock_key = f"{sync_env['CLAWRL_SYNC__LOCK_KEY']}-start-{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(redis_url)
    if sync_running:
        client.set(lock_key, "job-elsewhere", ex=60)
    generation, held = held_by_a_paused_engine(engine)
    settings = WeightSyncSettings(
        redis={"url": redis_url, "versions_stream": sync_env["CLAWRL_REDIS__VERSIONS_STREAM"]},
        engines={"urls": [engine]},
        sync={"results_stream": sync_env["CLAWRL_SYNC__RESULTS_STREAM"], "lock_key": lock_key},
    )
    metrics = WeightSyncMetrics()

    async def never(ready: VersionReady) -> int:
        raise AssertionError("no sync is launched by start()")

    async def go():
        async_client = redis.asyncio.Redis.from_url(redis_url)
        try:
            await SyncWatcher(settings, async_client, never, metrics).start()
        finally:
            await async_client.aclose()

    try:
        asyncio.run(go())
        generation.join(timeout=3.0 if sync_running else 60)
        # Still held under a running sync (whose own continue ends it); answered otherwise.
        assert generation.is_alive() == sync_running
    finally:
        httpx.post(f"{engine}/continue_generation", json={}, timeout=10)
        client.delete(lock_key)
        generation.join(timeout=60)
    assert held and held[0].status_code == 200, held
    assert metrics.registry.get_sample_value("clawrl_weight_sync_continue_failures_total") == 0
