"""The CPU engine (float32 and bfloat16) and real SGLang side by side, on this machine, in one run:
decode tokens/s at 1, 8 and 16 streams, cold prefill tokens/s at 512, 4k and 12k tokens against a
plain transformers forward pass in the same dtype, the time to first token of a cached follow-up
(the longest prompt plus a short new message), memory, start-up, the CPU an idle engine uses, the
CPU engine with 4 LoRA adapters loaded (every stream under an adapter: decode tokens/s and the
overhead against the same engine without adapters; its warm-up runs one stream alone under the
first adapter, which the engine then serves on merged weights, as it would a client of one
adapter), and the log-prob gap the trainer sees (|engine - float32 forward| over sampled rollouts,
and against a forward in the engine's own dtype). The transformers pass (SDPA) runs in this process
right before each engine prefill over the same ids (fresh ids per size and repeat), so each ratio
compares two passes that saw the same host. Prints one table (medians) and the ratios' ranges;
asserts nothing.

Each engine runs alone with the same threads; SGLang is started by the project's launcher
(`clawrl-engine --backend sglang`, its generic CPU path, bf16), the CPU engine as `make run`
starts it, with `--dtype` set per row. Both serve a 16k context (RoPE stretched alike). SGLang
needs `make setup-sglang`. Subsets: `--engines cpu-bf16 sglang`, `--parts decode prefill lora
gap`, `--streams 1 8`, `--prefill 512`, `--lora-adapters 0`.

    .venv/bin/python tests/bench/bench_engines.py [--model NAME] [--threads 2]
        [--engines cpu-f32 cpu-bf16 sglang] [--parts decode prefill lora gap]
        [--streams 1 8 16] [--prefill 512 4096 12288] [--repeats 1] [--new-tokens 64]
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from clawrl.common.models import resolve_model_dir, stretch_config  # noqa: E402
from clawrl.common.settings import ModelSettings  # noqa: E402
from clawrl.engine.launcher import CPU_ARGS, sglang_venv  # noqa: E402
from tests.bench.bench_engine import PROMPTS  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.integration.engine.lora_adapters import make_adapter  # noqa: E402

BIN = Path(sys.executable).parent
CONTEXT = 16384
FOLLOW_UP = 32  # new tokens of the cached follow-up
TIMEOUT = httpx.Timeout(3600.0)
# Engines by name: (row label, dtype of its weights and KV).
ENGINES = {
    "cpu-f32": ("CPU engine f32", "float32"),
    "cpu-bf16": ("CPU engine bf16", "bfloat16"),
    "sglang": ("SGLang bf16", "bfloat16"),
}
PARTS = ("decode", "prefill", "lora", "gap")
GAP_STREAMS = 8  # sampled rollouts (temperature 1) whose log-probs are checked
GAP_TOKENS = 64


def prompt_ids(n: int, seed: int) -> list[int]:
    """n token ids no earlier prompt shares a prefix with (a cold prefill)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 40000, (n,), generator=generator).tolist()


class Engine:
    """One engine process group on a free port, stopped on exit."""

    def __init__(self, kind: str, model: str, threads: int, *extra: str):
        self.kind = kind
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [str(BIN / "clawrl-engine"), "--host", "127.0.0.1", "--port", str(port),
                "--model", model, "--context-length", str(CONTEXT), *extra]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if kind == "sglang":
            argv += ["--backend", "sglang", "--max-total-tokens", str(2 * CONTEXT)]
            env |= {
                "CLAWRL_SGLANG__PYTHON": str(sglang_venv() / "bin" / "python"),
                "CLAWRL_SGLANG__DTYPE": "bfloat16",
                "CLAWRL_SGLANG__EXTRA_ARGS": json.dumps(list(CPU_ARGS)),
            }
        else:
            argv += ["--backend", "cpu", "--torch-threads", str(threads),
                     "--dtype", ENGINES[kind][1]]  # fmt: skip
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


async def generate_many(url: str, bodies: list[dict]) -> tuple[float, list[dict]]:
    """(seconds, replies) of concurrent /generate requests."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.post(f"{url}/generate", json=b) for b in bodies))
        seconds = time.perf_counter() - start
    for reply in replies:
        reply.raise_for_status()
    return seconds, [reply.json() for reply in replies]


def decode_rate(engine: Engine, prompts: list[list[int]], streams: int, new_tokens: int,
                adapters: list[str] | None = None) -> tuple[float, float]:  # fmt: skip
    """(tokens/s, tokens per CPU second of the engine) generated by `streams` concurrent greedy
    requests (request i under adapters[i % len(adapters)] when given). Per CPU second is the
    steadier figure on a shared host: wall time there is mostly waiting for a core."""
    bodies = []
    for i in range(streams):
        body = {"input_ids": prompts[i % len(prompts)],
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                    "ignore_eos": True}}  # fmt: skip
        if adapters:
            body["lora_path"] = adapters[i % len(adapters)]
        bodies.append(body)
    cpu = engine.cpu_s()
    seconds, replies = asyncio.run(generate_many(engine.url, bodies))
    cpu = max(engine.cpu_s() - cpu, 0.01)
    tokens = sum(r["meta_info"]["completion_tokens"] for r in replies)
    return tokens / seconds, tokens / cpu


class Baseline:
    """One transformers model in a dtype: a forward pass (SDPA, causal, no cache kept beyond the
    call) over ids with the logits of the last position only, as an engine prefills; and
    teacher-forced log-probs, as the trainer recomputes them."""

    def __init__(self, model_dir: Path, dtype: str, threads: int):
        torch.set_num_threads(threads)
        config = AutoConfig.from_pretrained(model_dir)
        stretch_config(config, CONTEXT, "yarn")
        self.dtype = dtype
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

    @torch.inference_mode()
    def logprobs(self, prompt: list[int], output: list[int]) -> torch.Tensor:
        """float32 log-probs of `output` after `prompt` from one forward pass."""
        logits = self.model(torch.tensor([prompt + output])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        return logp[torch.arange(len(output)), torch.tensor(output)]


def chat_prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for p in PROMPTS
    ]


def logprob_gap(url: str, prompts: list[list[int]], baselines: dict[str, Baseline]) -> dict:
    """|served log-prob - a forward pass's| over GAP_STREAMS concurrent sampled rollouts
    (temperature 1, seeded), per baseline dtype: {dtype: (mean, max, tokens)}."""
    bodies = [
        {
            "input_ids": prompts[i % len(prompts)],
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": GAP_TOKENS,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": i,
            },
        }
        for i in range(GAP_STREAMS)
    ]
    _, replies = asyncio.run(generate_many(url, bodies))
    gaps: dict[str, list[torch.Tensor]] = {dtype: [] for dtype in baselines}
    for body, reply in zip(bodies, replies, strict=True):
        served = torch.tensor([e[0] for e in reply["meta_info"]["output_token_logprobs"]])
        for dtype, baseline in baselines.items():
            expected = baseline.logprobs(body["input_ids"], reply["output_ids"])
            gaps[dtype].append((served - expected).abs())
    out = {}
    for dtype, parts in gaps.items():
        every = torch.cat(parts)
        out[dtype] = (float(every.mean()), float(every.max()), every.numel())
    return out


def measure_prefill(engine: Engine, sizes: list[int], repeats: int, baseline: Baseline | None,
                    rows: dict[str, dict], row: dict) -> list[int]:  # fmt: skip
    """Cold prefills of each size, each right after the baseline's pass over the same ids (its
    rates go to its row in `rows`); -> the last (longest) prompt."""
    generate(engine.url, prompt_ids(64, seed=1))  # warm-up of the prefill path
    ids: list[int] = []
    for n in sizes:
        for repeat in range(repeats):
            ids = prompt_ids(n, seed=n * 100 + repeat)
            if baseline is not None:
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
    return ids


def measure_engine(engine: Engine, args: argparse.Namespace, baselines: dict[str, Baseline],
                   prompts: list[list[int]], rows: dict[str, dict]) -> dict:  # fmt: skip
    """The engine's row: decode, prefill (paired with the transformers pass in its dtype), the
    cached follow-up, memory, log-prob gap."""
    row: dict = {"start_s": engine.start_s, "idle_cpu": engine.idle_cpu()}
    if "decode" in args.parts:
        decode_rate(engine, prompts, 2, 8)  # warm-up
        for streams in args.streams:
            wall, per_cpu = decode_rate(engine, prompts, streams, args.new_tokens)
            row[f"decode_{streams}"] = (wall, per_cpu)
            print(f"  {engine.kind}: decode {streams} streams: {wall:.1f} tok/s, {per_cpu:.1f} "
                  "per CPU s", flush=True)  # fmt: skip
    if "prefill" in args.parts and args.prefill:
        baseline = baselines.get(ENGINES[engine.kind][1])
        ids = measure_prefill(engine, args.prefill, args.repeats, baseline, rows, row)
        # A follow-up to the longest prompt: cached unless the engine evicted it.
        seconds, meta = generate(engine.url, ids + prompt_ids(FOLLOW_UP, seed=7))
        row["follow_up_s"], row["follow_up_cached"] = seconds, meta.get("cached_tokens")
    if "gap" in args.parts:
        row["gap"] = logprob_gap(engine.url, prompts, baselines)
    row["rss_mb"], row["peak_mb"] = engine.memory_mb()
    return row


def measure_lora(kind: str, args: argparse.Namespace, adapters: list[Path],
                 prompts: list[list[int]], plain: dict) -> dict:  # fmt: skip
    """Decode with len(adapters) adapters loaded, each stream under one (round robin), and
    the overhead against the same engine without adapters (`plain`, its row)."""
    paths = [f"a{i}={path}" for i, path in enumerate(adapters)]
    names = [f"a{i}" for i in range(len(adapters))]
    row: dict = {}
    with Engine(kind, args.model, args.threads, "--lora-paths", *paths) as engine:
        decode_rate(engine, prompts, 2, 8, names)  # warm-up
        # and one stream alone under the first adapter, as a client of one adapter does: the
        # engine merges its weights once (engine.lora_merge_after), not in the measured run
        decode_rate(engine, prompts, 1, 16, names)
        for streams in args.streams:
            wall, per_cpu = decode_rate(engine, prompts, streams, args.new_tokens, names)
            row[f"decode_{streams}"] = (wall, per_cpu)
            if f"decode_{streams}" in plain:  # CPU per token, against the plain engine's
                row[f"overhead_{streams}"] = plain[f"decode_{streams}"][1] / per_cpu - 1
            print(f"  {kind} + {len(adapters)} adapters: decode {streams} streams: {wall:.1f} "
                  f"tok/s, {per_cpu:.1f} per CPU s", flush=True)  # fmt: skip
        row["rss_mb"], row["peak_mb"] = engine.memory_mb()
        row["start_s"] = engine.start_s
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


def report(rows: dict[str, dict], args: argparse.Namespace, load: list[float]) -> None:
    sizes = args.prefill if "prefill" in args.parts else []
    print(
        f"\n{args.model}, {args.threads} threads, {os.cpu_count()} CPUs, load average (1 min) "
        f"{min(load):.1f}-{max(load):.1f} over the run; decode: {args.new_tokens} new tokens "
        "per stream, greedy, total tokens per second (per CPU second of the engine: steadier on "
        "a shared host; with LoRA, + the CPU per token it adds); prefill: the same; log-prob "
        "gap: |served - a forward pass's| over "
        f"{GAP_STREAMS}x{GAP_TOKENS} sampled tokens, mean / max"
    )
    decode_cols = [f"decode {s}" for s in args.streams] if "decode" in args.parts else []
    prefill_cols = [f"prefill {n}" for n in sizes]
    header = ["", *decode_cols, *prefill_cols, "follow-up s", "RSS MB", "start s", "idle CPU",
              "gap vs f32", "gap vs own dtype"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, row in rows.items():
        cells = [name]
        for s in args.streams if decode_cols else []:
            value = row.get(f"decode_{s}")
            over = row.get(f"overhead_{s}")
            cells.append("" if value is None else f"{value[0]:.1f} ({value[1]:.1f})"
                         + ("" if over is None else f" {over:+.0%}"))  # fmt: skip
        cells += [rate(row[f"prefill_{n}"]) if f"prefill_{n}" in row else "" for n in sizes]
        cells.append(f"{row['follow_up_s']:.2f} ({row['follow_up_cached']})"
                     if "follow_up_s" in row else "")  # fmt: skip
        cells.append(f"{row['rss_mb']:.0f}" if "rss_mb" in row else "")
        cells.append(f"{row['start_s']:.0f}" if "start_s" in row else "")
        cells.append(f"{row['idle_cpu']:.0%}" if "idle_cpu" in row else "")
        gap = row.get("gap", {})
        own = ENGINES.get(row.get("kind", ""), ("", ""))[1]
        cells += [
            f"{gap[d][0]:.2g} / {gap[d][1]:.2g}" if d in gap else "" for d in ("float32", own)
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    ratios(rows, sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--prefill", type=int, nargs="*", default=[512, 4096, 12288])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="cold prefills per size and engine")
    parser.add_argument("--lora-adapters", type=int, default=4, help="0: no LoRA rows")
    args = parser.parse_args()
    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    prompts = chat_prompts(model_dir)
    dtypes = {ENGINES[kind][1] for kind in args.engines}
    if "gap" in args.parts:
        dtypes.add("float32")  # the trainer's recomputation
    baselines = {d: Baseline(model_dir, d, args.threads) for d in sorted(dtypes)}
    rows: dict[str, dict] = {b.name: {} for b in baselines.values()} if "prefill" in args.parts \
        else {}  # fmt: skip
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [make_adapter(model_dir, Path(tmp) / f"a{i}", rank=16, alpha=32, seed=i)
                    for i in range(args.lora_adapters if "lora" in args.parts else 0)]  # fmt: skip
        for kind in args.engines:
            print(f"==> {kind}", flush=True)
            name = ENGINES[kind][0]
            with Engine(kind, args.model, args.threads) as engine:
                rows[name] = measure_engine(engine, args, baselines, prompts, rows)
            rows[name]["kind"] = kind
            load.append(os.getloadavg()[0])
            if adapters and kind != "sglang":  # SGLang's LoRA kernels are GPU-only
                print(f"==> {kind} + {len(adapters)} LoRA adapters", flush=True)
                lora = measure_lora(kind, args, adapters, prompts, rows[name])
                rows[f"{name} + {len(adapters)} LoRA"] = lora
                load.append(os.getloadavg()[0])
    report(rows, args, load)


if __name__ == "__main__":
    main()
