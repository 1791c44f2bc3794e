"""The demo that trends: `make run`'s stack (its defaults: a LoRA adapter of SmolLM2-135M,
lr 5e-4, the batch's mean reward as baseline, the judge's `stated_preference`) driven by
`clawrl simulate`: the simulated user asks open questions, wants one paragraph and says so; the
trainer steps and each version is loaded with no pause. Prints the per-version table (the
user's check, the judged reward, the held-out score), the goal's two figures (mean reward of the
last 3 versions vs v0, held-out score of the final version vs v0) and writes the CSV and PNG (to
docs/ with --docs). Asserts nothing.

    .venv/bin/python tests/bench/bench_learning.py [--minutes 20] [--seed 0] [--docs]
    .venv/bin/python tests/bench/bench_learning.py --stack-args="--lora-rank 0 --lr 1e-5"
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from tests.conftest import free_port  # noqa: E402

NAMES = ("gateway", "grpc", "policy", "judge", "redis", "prometheus", "judge-grpc",
         "judge-metrics", "trainer-metrics", "sync-metrics")  # fmt: skip


def goal(csv_path: Path) -> str:
    """The issue's two figures from the simulator's CSV: mean reward of the last 3 versions with
    a reward vs v0's, held-out score of the final evaluated version vs v0's."""
    rows = list(csv.DictReader(csv_path.open()))
    rewarded = [(int(r["policy_version"]), float(r["reward_mean"])) for r in rows
                if r["reward_mean"]]  # fmt: skip
    scored = [(int(r["policy_version"]), float(r["held_out_score"])) for r in rows
              if r.get("held_out_score")]  # fmt: skip
    lines = []
    if rewarded and rewarded[0][0] == 0 and len(rewarded) >= 4:
        last = [reward for _, reward in rewarded[-3:]]
        gain = sum(last) / 3 - rewarded[0][1]
        lines.append(f"reward: v0 {rewarded[0][1]:+.3f}, last 3 versions "
                     f"{sum(last) / 3:+.3f} (gain {gain:+.3f}, goal >= +0.3)")  # fmt: skip
    if scored and scored[0][0] == 0 and len(scored) >= 2:
        gain = scored[-1][1] - scored[0][1]
        lines.append(f"held-out: v0 {scored[0][1]:.3f}, v{scored[-1][0]} {scored[-1][1]:.3f} "
                     f"(gain {gain:+.3f}, goal >= +0.2)")  # fmt: skip
    return "\n".join(lines) or "too few versions for the goal's figures"


def engine_held_out(
    engine_url: str, adapter: str | None, env: dict, taste: str = "paragraph"
) -> float | None:
    """`clawrl eval` against the policy engine itself, pinned to one version: the base model
    (v0) or an adapter (SGLang's lora_path), scored by the user of `taste`. Through the gateway
    a sync may split an evaluation between versions; here nothing can."""
    argv = [sys.executable, "-m", "clawrl.simulate.main", "eval", "--base-url",
            f"{engine_url}/v1", "--taste", taste,
            *(["--lora", adapter] if adapter else [])]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    found = re.findall(r"held-out score ([0-9.]+)", done.stdout)
    if done.returncode != 0 or not found:
        print(f"clawrl eval {adapter or 'base'} failed: {done.stdout}{done.stderr}", flush=True)
        return None
    return float(found[-1])


@contextlib.contextmanager
def running_stack(
    model: str, prefix: str, reward_fn: str, stack_args: list[str]
) -> Iterator[tuple[dict[str, int], Path, dict[str, str]]]:
    """stack.py on free ports, the judge's reward clawrl.judge.reward_examples:<reward_fn>,
    until its weight-sync launcher answers: (ports, run directory, the environment its clients
    should run with); stopped like Ctrl-C."""
    ports = {name: free_port() for name in NAMES}
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    # Every version's adapter stays on disk: the evaluator scores versions pinned, minutes after
    # they were announced, and an adapter pruned in between fails its evaluation.
    env = {**os.environ, "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
           "CLAWRL_CHECKPOINT__KEEP_VERSIONS": "1000"}  # fmt: skip
    log = (run_dir / "stack.log").open("wb")
    stack = subprocess.Popen(
        [sys.executable, str(REPO / "deploy/local/stack.py"),
         "--policy-model", model, "--judge-model", "smollm2-tiny",
         *[arg for name in NAMES for arg in (f"--{name}-port", str(ports[name]))],
         "--reward-fn", f"clawrl.judge.reward_examples:{reward_fn}",
         "--run-dir", str(run_dir), *stack_args],
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
        yield ports, run_dir, env
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(timeout=120)
        log.close()


def simulate_until(ports: dict[str, int], env: dict, deadline: float, argv: list[str]) -> None:
    """`clawrl simulate` (3-turn sessions, no limit, and `argv`) against the stack until it ends
    or the deadline (time.monotonic()) passes; then stopped like Ctrl-C, so it still reports."""
    simulate = subprocess.Popen(
        [sys.executable, "-m", "clawrl.simulate.main", "simulate",
         "--base-url", f"http://127.0.0.1:{ports['gateway']}/v1",
         "--redis-url", f"redis://127.0.0.1:{ports['redis']}/0",
         "--sessions", "0", "--turns", "3", *argv],
        env=env,
    )  # fmt: skip
    try:
        simulate.wait(timeout=max(60.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        simulate.send_signal(signal.SIGINT)  # stop starting sessions, then report
        simulate.wait(timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument(
        "--minutes", type=float, default=20.0, help="from the stack's start to the last session"
    )
    parser.add_argument("--until-version", type=int, help="or stop at this version")
    parser.add_argument("--seed", type=int, default=0, help="the simulated user's seed")
    parser.add_argument("--scenario", default="preference", choices=("preference", "arithmetic"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--stack-args", default="", help="more stack.py flags (e.g. --lr 1e-3)")
    parser.add_argument("--docs", action="store_true", help="copy the CSV and PNG to docs/")
    args = parser.parse_args()
    started = time.monotonic()
    reward_fn = {"preference": "stated_preference", "arithmetic": "arithmetic_confirmed"}
    with running_stack(
        args.model, "bench-learning-", reward_fn[args.scenario], shlex.split(args.stack_args)
    ) as (ports, run_dir, env):
        print(f"stack up after {time.monotonic() - started:.0f}s", flush=True)
        out = run_dir / "simulate"
        until = ["--until-version", str(args.until_version)] if args.until_version else []
        # LoRA versions are scored against the engine pinned to each adapter (no sync can
        # split an evaluation); full-weight ones only through the gateway.
        extra = shlex.split(args.stack_args)
        full = "--lora-rank" in extra and extra[extra.index("--lora-rank") + 1] == "0"
        pinned = [] if full else ["--engine-url", f"http://127.0.0.1:{ports['policy']}"]
        simulate_until(
            ports, env, started + args.minutes * 60,
            ["--scenario", args.scenario, "--seed", str(args.seed), *pinned,
             "--concurrency", str(args.concurrency), *until, "--out-dir", str(out)],
        )  # fmt: skip
        [made_csv] = out.glob("simulate-*.csv")
        print(goal(made_csv))
        if args.scenario == "preference" and not full:
            final = max(int(r["policy_version"]) for r in csv.DictReader(made_csv.open()))
            engine = f"http://127.0.0.1:{ports['policy']}"
            base = engine_held_out(engine, None, env)
            last = engine_held_out(engine, f"policy-v{final}", env) if final else base
            if base is not None and last is not None:
                print(f"held-out (engine, pinned): v0 {base:.3f}, v{final} {last:.3f} "
                      f"(gain {last - base:+.3f}, goal >= +0.2)", flush=True)  # fmt: skip
        if args.docs:
            docs = REPO / "docs"
            docs.mkdir(exist_ok=True)
            for suffix in ("csv", "png"):
                [made] = out.glob(f"simulate-*.{suffix}")
                target = docs / f"learning-{args.model}-seed{args.seed}.{suffix}"
                shutil.copy(made, target)
                print(f"wrote {target}")
        print((run_dir / "stack.log").read_text().splitlines()[-1])


if __name__ == "__main__":
    main()
