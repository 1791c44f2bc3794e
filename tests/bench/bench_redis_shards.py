"""Benchmark: judge and trainer-intake throughput on one Redis with 1 shard vs a 3-primary Redis
Cluster with 3 shards, in one run. Prints a table; asserts only that every turn became exactly one
sample and every sample was taken in once.

Per layout and round (fresh stream names each round, the layouts interleaved so that a change in
the host's load hits both): the turn stream(s) are filled first (each turn into its session's
shard), then judge processes (`clawrl.judge.main`, trivial reward_fn, no engine) judge them all;
the judge rate is taken from the samples' stream ids (first to last, Redis stamps them in ms), so
start-up is not counted. Then the trainer's own Intake (a ShardedConsumer over the shards when
sharded) reads every sample in batches of 50 and acknowledges them: samples per second. CPU per
turn of the judges and of every Redis node is measured over the judging.

    .venv/bin/python tests/bench/bench_redis_shards.py [--turns 6000] [--judges 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from clawrl.common import redis_client  # noqa: E402
from clawrl.common.records import encode_entry  # noqa: E402
from clawrl.common.shards import Shards  # noqa: E402
from clawrl.trainer.intake import Intake  # noqa: E402
from clawrl.trainer.metrics import TrainerMetrics  # noqa: E402
from clawrl.trainer.service import make_consumer  # noqa: E402
from clawrl.trainer.settings import TrainerSettings  # noqa: E402
from tests.bench.bench_gateway import process_cpu_s  # noqa: E402
from tests.bench.bench_judge import turn  # noqa: E402
from tests.conftest import ChildProcess, free_port, wait_until  # noqa: E402
from tests.redis_cluster import start_cluster  # noqa: E402

BATCH = 50  # samples per intake batch


def names(prefix: str) -> dict[str, str]:
    """The [redis] stream names and key prefixes of one round (fresh, so rounds never mix)."""
    return {"turns_stream": f"{prefix}:turns", "samples_stream": f"{prefix}:samples",
            "deadletter_stream": f"{prefix}:dead"}  # fmt: skip


def ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


def fill(client, shards: Shards, prefix: str, n: int) -> None:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        record = turn(i)
        stream = shards.name(f"{prefix}:turns", shards.of(record.session_id))
        pipe.xadd(stream, encode_entry(record))
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()


def sample_count(client, shards: Shards, prefix: str) -> int:
    return sum(client.xlen(name) for name in shards.names(f"{prefix}:samples"))


def judge(client, shards: Shards, prefix: str, url: str, judges: int, n: int, workdir: Path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(p) for p in sorted(REPO.glob("services/*/src"))] + [str(REPO)]
        ),
        "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
        "CLAWRL_REDIS__URL": url,
        "CLAWRL_REDIS__CLUSTER": str(shards.cluster).lower(),
        "CLAWRL_REDIS__STREAM_SHARDS": str(shards.count),
        **{f"CLAWRL_REDIS__{key.upper()}": name for key, name in names(prefix).items()},
        "CLAWRL_AUDIT__STREAM": f"{prefix}:judgements",
        "CLAWRL_WORKERS__KEY_PREFIX": f"{prefix}:judge",
        "CLAWRL_JUDGING__REWARD_FN": "tests.bench.bench_judge:constant",
        "CLAWRL_BACKEND__ENGINE_URL": "",
        "CLAWRL_LOGGING__LEVEL": "WARNING",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clawrl.judge.main",
                "--consumer",
                f"bench-{j}",
                "--grpc-port",
                "0",
                "--metrics-port",
                "0",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(workdir / f"judge-{prefix}-{j}.log").open("wb"),
        )
        for j in range(judges)
    ]
    try:
        deadline = time.monotonic() + 900
        while not sample_count(client, shards, prefix) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a judge exited; see {workdir}")
            time.sleep(0.005)
        start = sample_count(client, shards, prefix)
        cpu0 = {p.pid: process_cpu_s(p.pid) for p in procs}
        while sample_count(client, shards, prefix) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        judge_cpu = sum(process_cpu_s(p.pid) - cpu0[p.pid] for p in procs)
        counted = max(sample_count(client, shards, prefix) - start, 1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=300)  # a loaded host drains slowly
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    firsts, lasts = [], []
    for name in shards.names(f"{prefix}:samples"):
        if client.xlen(name):
            firsts.append(ms(client.xrange(name, count=1)[0][0]))
            lasts.append(ms(client.xrevrange(name, count=1)[0][0]))
    done = sample_count(client, shards, prefix)
    seconds = max(max(lasts) - min(firsts), 1) / 1000
    turns = shards.names(f"{prefix}:turns")
    pending = sum(client.xpending(name, "judges")["pending"] for name in turns)
    return {"samples": done, "pending": pending, "judge_s": seconds,
            "turns_per_s": (done - 1) / seconds, "judge_cpu_ms": 1000 * judge_cpu / counted,
            "counted": counted}  # fmt: skip


async def intake(url: str, shards: Shards, prefix: str, n: int) -> dict:
    settings = TrainerSettings(
        redis={
            "url": url,
            "cluster": shards.cluster,
            "stream_shards": shards.count,
            **names(prefix),
        },
        consumer={"name": "bench", "block_ms": 200},
    )
    client = redis_client.connect(settings.redis, socket_timeout=10)
    try:
        consumer = make_consumer(settings, client)
        await consumer.ensure_group()
        taken = Intake(consumer, TrainerMetrics(), batch_size=BATCH, max_staleness=1000,
                       vocab_size=49152, max_length=8192)  # fmt: skip
        ids: list[str] = []
        stop = asyncio.Event()
        started = time.perf_counter()
        while len(ids) < n:
            batch = await taken.next_batch(1, lambda _: False, set(), stop, 200)
            assert batch is not None
            ids += [held.sample.sample_id for held in batch.held]
            await consumer.ack(*[h.entry.entry_id for h in batch.held], *batch.ack_with_step)
        seconds = time.perf_counter() - started
        assert len(set(ids)) == len(ids) == n, (len(set(ids)), len(ids), n)
        return {"intake_s": seconds, "samples_per_s": n / seconds}
    finally:
        await client.aclose()


def run_layout(layout: dict, prefix: str, args, workdir: Path) -> dict:
    name, shards, url, client = layout["name"], layout["shards"], layout["url"], layout["client"]
    print(f"{name} ({prefix}): filling, judging, intake", file=sys.stderr, flush=True)
    fill(client, shards, prefix, args.turns)
    redis_cpu0 = sum(process_cpu_s(pid) for pid in layout["pids"])
    result = judge(client, shards, prefix, url, args.judges, args.turns, workdir)
    redis_cpu = sum(process_cpu_s(pid) for pid in layout["pids"]) - redis_cpu0
    result["redis_cpu_ms"] = 1000 * redis_cpu / result["counted"]
    assert result["samples"] == args.turns and result["pending"] == 0, result
    result.update(asyncio.run(intake(url, shards, prefix, args.turns)))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=6000, help="turns per round and layout")
    parser.add_argument("--judges", type=int, default=2, help="judge processes per layout")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the layouts interleaved")
    args = parser.parse_args()
    args.turns = -(-args.turns // BATCH) * BATCH  # whole batches: a partial one never fills
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        port = free_port()
        single = ChildProcess("redis", ["redis-server", "--port", str(port), "--bind",
                              "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
                              workdir)  # fmt: skip
        cluster = None
        try:
            client = redis.Redis(port=port)
            wait_until(client.ping, 10, "redis", single.proc)
            cluster = start_cluster(workdir, primaries=3, name="bench-cluster")
            layouts = [
                {"name": "1 Redis, 1 shard", "shards": Shards(), "client": client,
                 "url": f"redis://127.0.0.1:{port}/0", "pids": [single.proc.pid]},
                {"name": "cluster, 3 primaries, 3 shards", "shards": Shards(3, cluster=True),
                 "client": redis.RedisCluster.from_url(cluster.url), "url": cluster.url,
                 "pids": [child.proc.pid for child in cluster.children]},
            ]  # fmt: skip
            for round_ in range(args.rounds):
                for layout in layouts:
                    result = run_layout(layout, f"r{round_}", args, workdir)
                    results.setdefault(layout["name"], []).append(result)
        finally:
            single.stop()
            if cluster is not None:
                cluster.stop()
    print(f"\n{args.turns} turns per round, {args.rounds} rounds (layouts interleaved, median "
          f"shown), {args.judges} judge processes, trivial reward_fn, {os.cpu_count()} CPUs "
          f"(load average {os.getloadavg()[0]:.1f})")  # fmt: skip
    print(f"{'layout':<32} {'judge turns/s':>13} {'judge CPU ms/turn':>18} "
          f"{'Redis CPU ms/turn':>18} {'intake samples/s':>17}  per round (turns/s)")  # fmt: skip
    for name, rounds in results.items():
        keys = ("turns_per_s", "judge_cpu_ms", "redis_cpu_ms", "samples_per_s")
        med = {key: statistics.median(r[key] for r in rounds) for key in keys}
        each = " ".join(f"{r['turns_per_s']:.0f}" for r in rounds)
        print(f"{name:<32} {med['turns_per_s']:>13.0f} {med['judge_cpu_ms']:>18.3f} "
              f"{med['redis_cpu_ms']:>18.3f} {med['samples_per_s']:>17.0f}  {each}")  # fmt: skip


if __name__ == "__main__":
    main()
