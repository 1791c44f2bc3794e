"""The CPU engine and real SGLang side by side, on this machine, in one run: decode tokens/s at 1
and 8 streams, cold prefill tokens/s at 1k, 4k and 13k tokens, the time to first token of a
cached follow-up (the 13k prompt plus a short new message), memory, and the CPU an idle engine
uses. A plain transformers forward pass (SDPA) over the same ids is the prefill baseline: it runs
in this process right before each engine prefill (`--repeats` times per size, fresh ids each
time), so each ratio compares two passes that saw the same host. Prints a table (medians) and
the ratios' ranges; asserts nothing.

Each engine runs alone with the same threads; SGLang is started by the project's launcher
(`clawrl-engine --backend sglang`, its generic CPU path, bf16), the CPU engine as `make run`
starts it (float32). Both serve a 16k context (RoPE stretched alike). Needs `make setup-sglang`.

    .venv/bin/python tests/bench/bench_engines.py [--model NAME] [--threads 2]
        [--prefill 1024 4096 13000] [--repeats 1] [--engines cpu sglang]
        [--baseline-dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch
from bench_engine import run_level
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from clawrl.common.models import resolve_model_dir, stretch_config  # noqa: E402
from clawrl.common.settings import ModelSettings  # noqa: E402
from clawrl.engine.launcher import CPU_ARGS, sglang_venv  # noqa: E402
from tests.conftest import free_port  # noqa: E402

BIN = Path(sys.executable).parent
CONTEXT = 16384
FOLLOW_UP = 32  # new tokens of the cached follow-up
TIMEOUT = httpx.Timeout(3600.0)


def prompt_ids(n: int, seed: int) -> list[int]:
    """n token ids no earlier prompt shares a prefix with (a cold prefill)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 40000, (n,), generator=generator).tolist()


class Engine:
    """One engine process group on a free port, stopped on exit."""

    def __init__(self, kind: str, model: str, threads: int):
        self.kind = kind
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [str(BIN / "clawrl-engine"), "--host", "127.0.0.1", "--port", str(port),
                "--model", model, "--context-length", str(CONTEXT)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if kind == "sglang":
            argv += ["--backend", "sglang", "--max-total-tokens", str(2 * CONTEXT)]
            env |= {
                "CLAWRL_SGLANG__PYTHON": str(sglang_venv() / "bin" / "python"),
                "CLAWRL_SGLANG__DTYPE": "bfloat16",
                "CLAWRL_SGLANG__EXTRA_ARGS": json.dumps(list(CPU_ARGS)),
            }
        else:
            argv += ["--backend", "cpu", "--torch-threads", str(threads)]
        self.log_path = Path(tempfile.gettempdir()) / f"bench-engines-{kind}-{port}.log"
        started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.wait_ready()
        self.start_s = time.monotonic() - started

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited ({self.proc.returncode}): {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health_generate", timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.kind} not ready: {self.log_path}")

    def processes(self) -> list[psutil.Process]:
        return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]

    def cpu_s(self) -> float:
        """CPU seconds the engine's processes have used (user + system)."""
        return sum(sum(p.cpu_times()[:2]) for p in self.processes())

    def idle_cpu(self, seconds: float = 10) -> float:
        """Share of one core the engine's processes use while nobody asks anything."""
        before = self.cpu_s()
        time.sleep(seconds)
        return (self.cpu_s() - before) / seconds

    def memory_mb(self) -> tuple[float, float]:
        """(RSS now, sum of each process's peak RSS) of the engine's processes, in MB."""
        procs = self.processes()
        rss = sum(p.memory_info().rss for p in procs) / 2**20
        peak = 0.0
        for p in procs:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak += int(line.split()[1]) / 1024
        return rss, peak

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # what is left of the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def generate(url: str, ids: list[int]) -> tuple[float, dict]:
    """(seconds, meta_info) of a one-token generation after `ids`."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    start = time.perf_counter()
    reply = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT)
    reply.raise_for_status()
    return time.perf_counter() - start, reply.json()["meta_info"]


class Baseline:
    """One transformers forward pass (SDPA, causal, no cache kept beyond the call) over the
    ids, then the logits of the last position only, as an engine computes them."""

    def __init__(self, model_dir: Path, dtype: str, threads: int):
        torch.set_num_threads(threads)
        config = AutoConfig.from_pretrained(model_dir)
        stretch_config(config, CONTEXT, "yarn")
        self.name = f"transformers {dtype}"
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=config, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).eval()
        self.prefill(prompt_ids(64, seed=1))  # warm-up

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> tuple[float, float]:
        """(seconds, CPU seconds) of the pass."""
        start, cpu = time.perf_counter(), time.process_time()
        hidden = self.model.model(torch.tensor([ids]), use_cache=False)
        self.model.lm_head(hidden.last_hidden_state[:, -1])
        return time.perf_counter() - start, time.process_time() - cpu


def measure_engine(
    engine: Engine,
    sizes: list[int],
    repeats: int,
    new_tokens: int,
    baselines: list[Baseline],
    rows: dict[str, dict],
) -> dict:
    """The engine's row; each cold prefill follows the baselines' passes over the same ids,
    whose rates go to their rows in `rows`."""
    row: dict = {"start_s": engine.start_s, "idle_cpu": engine.idle_cpu()}
    asyncio.run(run_level(engine.url, 2, 8, 1))  # warm-up
    for streams in (1, 8):
        row[f"decode_{streams}"] = asyncio.run(run_level(engine.url, streams, new_tokens, 1))
    generate(engine.url, prompt_ids(64, seed=1))  # warm-up of the prefill path
    for n in sizes:
        for repeat in range(repeats):
            ids = prompt_ids(n, seed=n * 100 + repeat)
            for baseline in baselines:
                seconds, cpu = baseline.prefill(ids)
                rates = rows.setdefault(baseline.name, {}).setdefault(f"prefill_{n}", [])
                rates.append((n / seconds, n / cpu))
                row.setdefault(f"paired_{n}", {}).setdefault(baseline.name, []).append(n / cpu)
                print(f"  {baseline.name}: {n} tokens: {seconds:.1f}s, {cpu:.1f} CPU s", flush=True)
            cpu = engine.cpu_s()
            seconds, _ = generate(engine.url, ids)
            cpu = max(engine.cpu_s() - cpu, 0.01)  # psutil counts in 10 ms ticks
            row.setdefault(f"prefill_{n}", []).append((n / seconds, n / cpu))
            print(
                f"  {engine.kind}: prefill {n} tokens: {seconds:.1f}s, {cpu:.1f} CPU s", flush=True
            )
    # A follow-up to the last (longest) prompt: cached unless the engine evicted it.
    seconds, meta = generate(engine.url, ids + prompt_ids(FOLLOW_UP, seed=7))
    row["follow_up_s"], row["follow_up_cached"] = seconds, meta.get("cached_tokens")
    row["rss_mb"], row["peak_mb"] = engine.memory_mb()
    return row


def rate(rates: list[tuple[float, float]]) -> str:
    """Median tokens/s (median tokens per CPU second) of the repeats."""
    per_s = statistics.median(r[0] for r in rates)
    per_cpu_s = statistics.median(r[1] for r in rates)
    return f"{per_s:.0f} ({per_cpu_s:.0f})"


def ratios(rows: dict[str, dict], sizes: list[int]) -> None:
    """Each engine's prefill tokens per CPU second over its paired baseline pass's."""
    for name, row in rows.items():
        for n in sizes:
            engine = [per_cpu for _, per_cpu in row.get(f"prefill_{n}", [])]
            for baseline, paired in row.get(f"paired_{n}", {}).items():
                each = [e / b for e, b in zip(engine, paired, strict=True)]
                print(
                    f"{name} / {baseline}, prefill {n}, per CPU second: "
                    f"{min(each):.2f}-{max(each):.2f}x (median {statistics.median(each):.2f}x, "
                    f"{len(each)} pairs: {' '.join(f'{x:.3f}' for x in each)})"
                )


def report(rows: dict[str, dict], sizes: list[int], args: argparse.Namespace) -> None:
    print(
        f"\n{args.model}, {args.threads} threads, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end; decode: {args.new_tokens} new tokens per stream; "
        f"prefill: tokens per second (per CPU second: steadier on a shared host)"
    )
    prefill = " ".join(f"{f'prefill {n}':>17}" for n in sizes)
    print(
        f"{'':<22} {'decode 1 tok/s':>14} {'decode 8 tok/s':>14} {prefill} "
        f"{'follow-up s':>11} {'(cached)':>8} {'RSS MB':>7} {'peak MB':>7} {'start s':>7} "
        f"{'idle CPU':>8}"
    )
    for name, row in rows.items():
        decode = "".join(
            f"{row[f'decode_{s}']['tok_s']:>15.1f}" if f"decode_{s}" in row else f"{'':>15}"
            for s in (1, 8)
        )
        prefills = " ".join(f"{rate(row[f'prefill_{n}']):>17}" for n in sizes)
        tail = (
            f"{row['follow_up_s']:>12.2f} {row['follow_up_cached']!s:>8} {row['rss_mb']:>7.0f} "
            f"{row['peak_mb']:>7.0f} {row['start_s']:>7.0f} {row['idle_cpu']:>8.0%}"
            if "follow_up_s" in row
            else ""
        )
        print(f"{name:<22}{decode} {prefills}{tail}")
    print()
    ratios(rows, sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prefill", type=int, nargs="+", default=[1024, 4096, 13000])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="cold prefills per size and engine")
    parser.add_argument(
        "--engines", nargs="+", choices=("cpu", "sglang"), default=["cpu", "sglang"]
    )
    parser.add_argument(
        "--baseline-dtypes", nargs="*", default=["float32", "bfloat16"], help="none: skip it"
    )
    args = parser.parse_args()
    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    baselines = [Baseline(model_dir, dtype, args.threads) for dtype in args.baseline_dtypes]
    rows: dict[str, dict] = {baseline.name: {} for baseline in baselines}
    for kind in args.engines:
        print(f"==> {kind} engine", flush=True)
        with Engine(kind, args.model, args.threads) as engine:
            name = {"cpu": "CPU engine (f32)", "sglang": "SGLang (bf16)"}[kind]
            rows[name] = measure_engine(
                engine, args.prefill, args.repeats, args.new_tokens, baselines, rows
            )
    report(rows, args.prefill, args)


if __name__ == "__main__":
    main()
