"""A learning run of `clawrl simulate` on the whole local stack (`make run`'s processes) with
SmolLM2-135M: the simulated user asks arithmetic word problems, the judge rewards answers with
`arithmetic_confirmed`, the trainer steps and the weight syncs advance the policy. Prints the
per-version table (accuracy, judged reward) and how many steps in how many minutes, and writes
the CSV and PNG (to docs/ with --docs). Asserts nothing.

    .venv/bin/python tests/bench/bench_learning.py [--minutes 20] [--until-version 5] [--docs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from tests.conftest import free_port  # noqa: E402

NAMES = ("gateway", "grpc", "policy", "judge", "redis", "prometheus", "judge-grpc",
         "judge-metrics", "trainer-metrics", "sync-metrics")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--minutes", type=float, default=20.0, help="simulation time limit")
    parser.add_argument("--until-version", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", default="1e-5", help="trainer learning rate (ppo.lr)")
    parser.add_argument("--docs", action="store_true", help="copy the CSV and PNG to docs/")
    args = parser.parse_args()
    ports = {name: free_port() for name in NAMES}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-learning-"))
    env = {**os.environ, "CLAWRL_CONFIG": "/nonexistent/clawrl.toml", "CLAWRL_PPO__LR": args.lr}
    log = (run_dir / "stack.log").open("wb")
    stack = subprocess.Popen(
        [sys.executable, str(REPO / "deploy/local/stack.py"),
         "--policy-model", args.model, "--judge-model", "smollm2-tiny",
         *[arg for name in NAMES for arg in (f"--{name}-port", str(ports[name]))],
         "--reward-fn", "clawrl.judge.reward_examples:arithmetic_confirmed",
         "--batch-size", str(args.batch_size), "--sync-interval", "1", "--run-dir", str(run_dir)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while True:
            if stack.poll() is not None:
                sys.exit(f"the stack exited: see {run_dir / 'stack.log'}")
            try:
                url = f"http://127.0.0.1:{ports['sync-metrics']}/metrics"
                if httpx.get(url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"the stack did not start: see {run_dir / 'stack.log'}")
            time.sleep(1)
        out = run_dir / "simulate"
        simulate = subprocess.Popen(
            [sys.executable, "-m", "clawrl.simulate.main", "simulate",
             "--base-url", f"http://127.0.0.1:{ports['gateway']}/v1",
             "--redis-url", f"redis://127.0.0.1:{ports['redis']}/0",
             "--sessions", "0", "--turns", "3", "--concurrency", str(args.concurrency),
             "--until-version", str(args.until_version), "--out-dir", str(out)],
            env=env,
        )  # fmt: skip
        try:
            simulate.wait(timeout=args.minutes * 60)
        except subprocess.TimeoutExpired:
            simulate.send_signal(signal.SIGINT)  # stop starting sessions, then report
            simulate.wait(timeout=600)
        if args.docs:
            docs = REPO / "docs"
            docs.mkdir(exist_ok=True)
            for suffix in ("csv", "png"):
                [made] = out.glob(f"simulate-*.{suffix}")
                shutil.copy(made, docs / f"learning-{args.model}.{suffix}")
                print(f"wrote {docs / f'learning-{args.model}.{suffix}'}")
        print((run_dir / "stack.log").read_text().splitlines()[-1])
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(timeout=120)
        log.close()


if __name__ == "__main__":
    main()
