"""Real SGLang (`make setup-sglang`) on CPU, started from the launcher's own argv: one server per
test module, one thread, a small KV pool. `make test-sglang` runs these; `make test` does not."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.launcher import build_argv, build_env
from clawrl.engine.settings import EngineServerSettings, EngineSettings, SGLangSettings
from tests.conftest import REPO, free_port, wait_http

MODEL = "SmolLM2-135M-Instruct"
# SGLang's generic PyTorch path: the CPU build of sgl-kernel that SGLang's own CPU engine needs
# is not on PyPI.
CPU_FLAGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--grammar-backend", "none",
    "--skip-server-warmup",
    "--max-total-tokens", "4096",
]  # fmt: skip
START_TIMEOUT_S = 600  # ~40 s on an idle machine; much longer beside other tests


def sglang_python() -> Path:
    """The SGLang venv's interpreter (scripts/setup-sglang.sh), or a failure saying how to
    make it: these tests are selected on purpose, so a missing venv is an error, not a skip."""
    venv = os.environ.get("CLAWRL_SGLANG_VENV") or str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "clawrl" / "sglang-venv"
    )
    python = Path(venv) / "bin" / "python"
    if not (Path(venv) / ".clawrl-sglang-stamp").is_file():
        pytest.fail(f"no SGLang venv at {venv}: run `make setup-sglang` first")
    return python


def engine_settings(port: int, **sglang) -> EngineSettings:
    return EngineSettings(
        model=ModelSettings(path=MODEL),
        engine=EngineServerSettings(host="127.0.0.1", port=port),
        sglang=SGLangSettings(
            python=str(sglang_python()),
            dtype="bfloat16",
            extra_args=CPU_FLAGS + list(sglang.pop("extra_args", [])),
            **sglang,
        ),
    )


def sglang_env(settings: EngineSettings) -> dict[str, str]:
    return build_env(settings, {**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def sglang_url(request, log_dir: Path) -> Iterator[str]:
    """A real SGLang server for this module, started exactly as `clawrl-engine --backend
    sglang` would start it."""
    settings = engine_settings(free_port())
    url = f"http://127.0.0.1:{settings.engine.port}"
    log_path = log_dir / f"sglang-{request.module.__name__.rsplit('.', 1)[-1]}.log"
    with log_path.open("wb") as log:
        # Its own process group: SGLang's scheduler and detokenizer are child processes, and
        # none may outlive the module.
        proc = subprocess.Popen(
            build_argv(settings),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=sglang_env(settings),
            start_new_session=True,
        )
        try:
            wait_http(f"{url}/health_generate", proc, "sglang", timeout_s=START_TIMEOUT_S)
            yield url
        except Exception:
            print(log_path.read_text(errors="replace")[-4000:])
            raise
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
        return


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model_dir(ModelSettings(path=MODEL))


def run_in_sglang(
    code: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Python code run by the SGLang venv's interpreter."""
    return subprocess.run(
        [str(sglang_python()), "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def relative_gap(served: list[float], reference: list[float]) -> float:
    """Log-probs' disagreement over a reply: sum of |served - reference| over the sum of
    |reference| (bf16 decode against prefill: ~1 %; tempered log-probs: 17-26 %)."""
    gap = sum(abs(a - b) for a, b in zip(served, reference, strict=True))
    return gap / sum(abs(b) for b in reference)
