"""Benchmark of the judge pipeline's own cost: turns per second through clawrl:turns -> judge ->
clawrl:samples with a trivial reward_fn (no engine call), with 1 and 2 worker processes, and the
CPU each turn costs the judge and Redis. Prints a table; asserts nothing.

The stream is filled first, then the workers start; the rate is taken from the stream ids of the
first and last sample (Redis stamps them in ms), so start-up is not counted.

    .venv/bin/python tests/bench/bench_judge.py [--turns 20000] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from clawrl.common.proto.records_pb2 import FinalizeReason  # noqa: E402
from clawrl.common.records import Turn, encode_entry  # noqa: E402
from tests.bench.bench_gateway import free_port, process_cpu_s  # noqa: E402


def constant(turn) -> float:
    """The trivial reward_fn: the pipeline's own cost is what is measured."""
    return 1.0


def turn(i: int) -> Turn:
    """A turn of typical size: 300 prompt ids, 120 response ids, a short chat."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 4},
        {"role": "user", "content": f"Question number {i}: what is {i} + {i}?"},
    ]
    t = Turn(
        turn_id=f"bench-{i // 4}:{i % 4}",
        session_id=f"bench-{i // 4}",
        turn_index=i % 4,
        model="bench",
        policy_version=1,
        weight_version="1",
        messages_json=json.dumps(messages),
        prompt_ids=list(range(300)),
        response_ids=list(range(1000, 1120)),
        response_logprobs=[-0.25] * 120,
        response_text=f"The answer is {2 * i}.",
        response_message_json=json.dumps({"role": "assistant", "content": f"It is {2 * i}."}),
        next_state_messages_json=[json.dumps({"role": "user", "content": "thanks"})],
        finalize_reason=FinalizeReason.FINALIZE_REASON_NEXT_STATE,
        temperature=1.0,
        top_p=1.0,
    )
    t.next_state_json = t.next_state_messages_json[0]
    return t


def fill(r: redis.Redis, stream: str, n: int) -> None:
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(stream, encode_entry(turn(i)))
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()


def ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


def run(workers: int, n: int, workdir: Path) -> dict[str, float]:
    port = free_port()
    redis_proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    r = redis.Redis(port=port)
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(100):
            try:
                if r.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.05)
        fill(r, "clawrl:turns", n)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(p) for p in sorted(REPO.glob("services/*/src"))] + [str(REPO)]
            ),
            "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
            "CLAWRL_REDIS__URL": f"redis://127.0.0.1:{port}/0",
            "CLAWRL_JUDGING__REWARD_FN": "tests.bench.bench_judge:constant",
            "CLAWRL_BACKEND__ENGINE_URL": "",
            "CLAWRL_LOGGING__LEVEL": "WARNING",
        }
        for w in range(workers):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "clawrl.judge.main", "--consumer", f"bench-{w}",
                 "--grpc-port", "0", "--metrics-port", "0"],
                env=env, stdout=subprocess.DEVNULL, stderr=(workdir / f"judge-{w}.log").open("wb"),
            ))  # fmt: skip
        # CPU is counted from the first sample on: process start-up (imports) is not the
        # pipeline's cost.
        deadline = time.monotonic() + 600
        while not r.xlen("clawrl:samples") and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a judge exited; see {workdir}")
            time.sleep(0.005)
        start_count = r.xlen("clawrl:samples")
        cpu0 = {p.pid: process_cpu_s(p.pid) for p in procs}
        redis_cpu0 = process_cpu_s(redis_proc.pid)
        while r.xlen("clawrl:samples") < n and time.monotonic() < deadline:
            time.sleep(0.1)
        counted = max(r.xlen("clawrl:samples") - start_count, 1)
        judge_cpu = sum(process_cpu_s(p.pid) - cpu0[p.pid] for p in procs)
        redis_cpu = process_cpu_s(redis_proc.pid) - redis_cpu0
        first = r.xrange("clawrl:samples", count=1)[0][0]
        last = r.xrevrange("clawrl:samples", count=1)[0][0]
        done = r.xlen("clawrl:samples")
        elapsed = max(ms(last) - ms(first), 1) / 1000
        pending = r.xpending("clawrl:turns", "judges")["pending"]
        return {
            "samples": done,
            "pending": pending,
            "seconds": elapsed,
            "turns_per_s": (done - 1) / elapsed,
            "judge_cpu_ms": 1000 * judge_cpu / counted,
            "redis_cpu_ms": 1000 * redis_cpu / counted,
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
        redis_proc.terminate()
        redis_proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=20000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(f"judge pipeline, trivial reward_fn, {args.turns} turns, {os.cpu_count()} CPUs")
    print(f"{'workers':>7} {'turns/s':>9} {'seconds':>8} {'judge CPU ms/turn':>18} "
          f"{'redis CPU ms/turn':>18} {'samples':>8} {'pending':>8}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            res = run(workers, args.turns, Path(tmp))
            print(f"{workers:>7} {res['turns_per_s']:>9.0f} {res['seconds']:>8.2f} "
                  f"{res['judge_cpu_ms']:>18.3f} {res['redis_cpu_ms']:>18.3f} "
                  f"{res['samples']:>8} {res['pending']:>8}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
