"""The demo that trends: `make run`'s stack (its defaults: a LoRA adapter of SmolLM2-135M,
lr 5e-4, the batch's mean reward as baseline) with one method (`--method rl|opd|combine`, the
stack's switch; rl's reward from `--reward-fn`, or the judge's PRM with `--reward-fn judge`)
driven by `clawrl simulate`: the simulated user asks open questions, wants one paragraph and says
so (`--remarks fixed`: one sentence per verdict; `varied`: worded freely); the trainer steps and
each version is loaded with no pause. Prints the per-version table (the user's check, the judged
reward, the held-out score, the base model's NLL of the held-out replies), the goal's figures
(mean reward of the last 3 versions vs v0, held-out score and base NLL of the final version vs
v0), what the judge and the trainer counted (hint yield, valid votes, skipped batches), and
writes the CSV (with method, seed, remarks and those counts in every row) and PNG (to
docs/learning-<label>-seed<N>.* with --docs; tests/bench/learning_summary.py tables and plots
them all). Asserts nothing.

    .venv/bin/python tests/bench/bench_learning.py [--minutes 20] [--seed 0] [--docs]
    .venv/bin/python tests/bench/bench_learning.py --method opd --remarks varied --docs
    .venv/bin/python tests/bench/bench_learning.py --method rl --reward-fn judge --remarks varied
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
from prometheus_client.parser import text_string_to_metric_families

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
    fluent = [(int(r["policy_version"]), float(r["held_out_base_nll"])) for r in rows
              if r.get("held_out_base_nll")]  # fmt: skip
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
    if fluent and fluent[0][0] == 0 and len(fluent) >= 2:
        lines.append(f"base NLL per token of the held-out replies: v0 {fluent[0][1]:.3f}, "
                     f"v{fluent[-1][0]} {fluent[-1][1]:.3f} (a collapse raises it)")  # fmt: skip
    return "\n".join(lines) or "too few versions for the goal's figures"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, its labels) -> value of one /metrics page ({} when it does not answer)."""
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def signal_counts(judge: dict, trainer: dict) -> str:
    """What the judge and the trainer counted over a run, from their /metrics: why a method
    learns or not (no accepted hint, no valid PRM vote, batches with no signal)."""

    def total(metrics: dict, name: str, **labels: str) -> int:
        return int(sum(value for (sample, found), value in metrics.items() if sample == name
                       and all((k, v) in found for k, v in labels.items())))  # fmt: skip

    parts = []
    hinted = total(judge, "clawrl_judge_hints_total", result="accepted")
    asked = hinted + total(judge, "clawrl_judge_hints_total", result="none")
    if asked:
        sources = [f"{source} {total(judge, 'clawrl_judge_hint_sources_total', source=source)}"
                   for source in ("feedback", "hint_fn", "judge")]  # fmt: skip
        parts.append(f"hint yield {hinted}/{asked} ({', '.join(sources)})")
    votes = total(judge, "clawrl_judge_votes_total", kind="prm")
    if votes:
        valid = total(judge, "clawrl_judge_votes_total", kind="prm", result="valid")
        parts.append(f"PRM votes valid {valid}/{votes}")
    masked = {dict(found).get("reason", ""): int(value) for (sample, found), value in
              judge.items() if sample == "clawrl_judge_masked_samples_total" and value}  # fmt: skip
    if masked:
        parts.append("masked " + ", ".join(f"{k} {v}" for k, v in sorted(masked.items())))
    parts.append(f"steps {total(trainer, 'clawrl_trainer_steps_total')}")
    skipped = total(trainer, "clawrl_trainer_batches_skipped_total")
    if skipped:
        parts.append(f"batches skipped {skipped}")
    return "; ".join(parts)


def reward_spec(value: str, scenario: str, remarks: str) -> str | None:
    """--reward-fn: auto (the reward that reads this user's words), judge (none: the judge's
    PRM), a reward_examples name, or module:function."""
    if value == "auto":
        value = ("arithmetic_confirmed" if scenario == "arithmetic" else
                 "remark_sentiment" if remarks == "varied" else "stated_preference")  # fmt: skip
    if value in ("judge", ""):
        return None
    return value if ":" in value else f"clawrl.judge.reward_examples:{value}"


def write_docs_csv(made: Path, target: Path, run: dict[str, str]) -> None:
    """The simulator's CSV with the run's settings (method, seed, remarks...) in every row."""
    rows = list(csv.DictReader(made.open()))
    with target.open("w", newline="") as out:
        writer = csv.DictWriter(out, [*rows[0], *run] if rows else [*run])
        writer.writeheader()
        writer.writerows({**row, **run} for row in rows)


def engine_held_out(
    engine_url: str, adapter: str | None, env: dict, taste: str = "paragraph"
) -> float | None:
    """`clawrl eval` against the policy engine itself, pinned to one version: the base model
    (v0) or an adapter (SGLang's lora_path), scored by the user of `taste`. Through the gateway
    a sync may split an evaluation between versions; here nothing can."""
    argv = [sys.executable, "-m", "clawrl.simulate.main", "eval", "--base-url",
            f"{engine_url}/v1", "--taste", taste,
            *(["--lora", adapter] if adapter else [])]  # fmt: skip
    argv += ["--engine-url", engine_url]  # and the replies' base NLL (printed with the score)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    print(done.stdout, end="", flush=True)
    found = re.findall(r"held-out score ([0-9.]+)", done.stdout)
    if done.returncode != 0 or not found:
        print(f"clawrl eval {adapter or 'base'} failed: {done.stdout}{done.stderr}", flush=True)
        return None
    return float(found[-1])


@contextlib.contextmanager
def running_stack(
    model: str,
    prefix: str,
    reward_fn: str | None,
    stack_args: list[str],
    judge_model: str = "smollm2-tiny",
) -> Iterator[tuple[dict[str, int], Path, dict[str, str]]]:
    """stack.py on free ports, the judge's reward `reward_fn` (module:function, or a name in
    clawrl.judge.reward_examples; None: the stack's own choice), until its weight-sync launcher
    answers: (ports, run directory, the environment its clients should run with); stopped like
    Ctrl-C."""
    ports = {name: free_port() for name in NAMES}
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    # Every version's adapter stays on disk: the evaluator scores versions pinned, minutes after
    # they were announced, and an adapter pruned in between fails its evaluation.
    env = {**os.environ, "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
           "CLAWRL_CHECKPOINT__KEEP_VERSIONS": "1000"}  # fmt: skip
    log = (run_dir / "stack.log").open("wb")
    if reward_fn and ":" not in reward_fn:
        reward_fn = f"clawrl.judge.reward_examples:{reward_fn}"
    stack = subprocess.Popen(
        [sys.executable, str(REPO / "deploy/local/stack.py"),
         "--policy-model", model, "--judge-model", judge_model,
         *[arg for name in NAMES for arg in (f"--{name}-port", str(ports[name]))],
         *(["--reward-fn", reward_fn] if reward_fn else []),
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
    parser.add_argument(
        "--method", choices=("rl", "opd", "combine"), default="rl", help="the stack's --method"
    )
    parser.add_argument(
        "--reward-fn",
        default="auto",
        help="rl/combine's reward: auto (the plug-in that reads this user's words: "
        "stated_preference, remark_sentiment with --remarks varied, arithmetic_confirmed), "
        "judge (the judge's PRM), a clawrl.judge.reward_examples name or module:function",
    )
    parser.add_argument(
        "--hint-fn", help="opd/combine: the stack's --hint-fn ('' = the judge's hint votes)"
    )
    parser.add_argument(
        "--remarks", choices=("fixed", "varied"), default="fixed", help="the user's wording"
    )
    parser.add_argument(
        "--judge-model",
        help="the judge engine's model (default: --model when the PRM scores, else the tiny "
        "model, which nothing asks)",
    )
    parser.add_argument(
        "--label", help="names the run in docs/learning-<label>-seed<N>.* (default: the method, "
        "rl-prm for rl scored by the judge)",
    )  # fmt: skip
    parser.add_argument("--stack-args", default="", help="more stack.py flags (e.g. --lr 1e-3)")
    parser.add_argument("--docs", action="store_true", help="copy the CSV and PNG to docs/")
    args = parser.parse_args()
    started = time.monotonic()
    reward_fn = reward_spec(args.reward_fn, args.scenario, args.remarks)
    label = args.label or args.method + ("-prm" if args.method == "rl" and not reward_fn else "")
    judge_model = args.judge_model or ("smollm2-tiny" if reward_fn else args.model)
    stack_args = ["--method", args.method,
                  *(["--hint-fn", args.hint_fn] if args.hint_fn is not None else []),
                  *shlex.split(args.stack_args)]  # fmt: skip
    stack = running_stack(args.model, "bench-learning-", reward_fn, stack_args, judge_model)
    with stack as (ports, run_dir, env):
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
             "--remarks", args.remarks,
             "--concurrency", str(args.concurrency), *until, "--out-dir", str(out)],
        )  # fmt: skip
        [made_csv] = out.glob("simulate-*.csv")
        print(goal(made_csv))
        counts = signal_counts(
            scrape(f"http://127.0.0.1:{ports['judge-metrics']}/metrics"),
            scrape(f"http://127.0.0.1:{ports['trainer-metrics']}/metrics"),
        )
        print(f"judge and trainer counted: {counts}", flush=True)  # fmt: skip
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
            run = {"method": label, "seed": str(args.seed), "remarks": args.remarks,
                   "reward_fn": reward_fn or "judge", "model": args.model,
                   "minutes": f"{args.minutes:g}", "signal": counts}  # fmt: skip
            target = docs / f"learning-{label}-seed{args.seed}.csv"
            write_docs_csv(made_csv, target, run)
            [made_png] = out.glob("simulate-*.png")
            shutil.copy(made_png, target.with_suffix(".png"))
            print(f"wrote {target} and .png")
        print((run_dir / "stack.log").read_text().splitlines()[-1])


if __name__ == "__main__":
    main()
