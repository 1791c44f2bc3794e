"""`make run`'s process supervisor (deploy/local/stack.py): stopping it leaves nothing behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_until

sys.path.insert(0, str(REPO / "deploy/local"))
import stack
from stack import Stack


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaps counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


# A service that starts a helper process of its own (as the trainer starts Ray's), which
# outlives it; "stubborn" also ignores SIGTERM (a trainer in the middle of a long step).
SERVICES = {
    "exits": "sleep 300 & echo $! > {pidfile}; wait",
    "stubborn": "trap '' TERM; sleep 300 & echo $! > {pidfile}; while true; do sleep 0.1; done",
}


@pytest.mark.parametrize("behaviour", sorted(SERVICES))
def test_stop_takes_the_processes_a_service_started_with_it(tmp_path, behaviour) -> None:
    pidfile = tmp_path / "helper.pid"
    stack = Stack("redis://127.0.0.1:1/0", tmp_path, stop_timeout_s=1)
    stack.start(
        "service",
        ["sh", "-c", SERVICES[behaviour].format(pidfile=pidfile)],
        lambda: pidfile.is_file() and pidfile.read_text().strip() != "",
        timeout_s=10,
    )
    helper = int(pidfile.read_text())
    stack.stop()
    assert stack.procs[0][1].returncode is not None
    wait_until(lambda: not alive(helper), 5, "the helper's end (a SIGKILL takes a moment)")


def test_a_restartable_service_is_rerun_until_its_restarts_run_out(tmp_path, capsys) -> None:
    # The judge, trainer and launcher are restartable (a crash of one does not end `make run`);
    # the rest are not: their exit ends the stack, as before.
    runs = tmp_path / "runs"
    stack = Stack("redis://127.0.0.1:1/0", tmp_path, stop_timeout_s=1)
    stack.start("service", ["sh", "-c", f"echo run >> {runs}; sleep 0.3; exit 3"],
                lambda: runs.is_file(), timeout_s=10, restarts=2)  # fmt: skip
    stack.start("steady", ["sleep", "300"], lambda: True, timeout_s=10)
    try:
        assert stack.wait(lambda: "", interval_s=60) == 3
    finally:
        stack.stop()
    assert runs.read_text().splitlines() == ["run"] * 3  # the first run and two restarts
    out = capsys.readouterr().out
    assert "restarting service (1 restart(s) left)" in out and "(0 restart(s) left)" in out
    assert [name for name, _ in stack.procs].count("service") == 1
    assert restartable_services() == ["judge", "trainer", "weight sync"]


def restartable_services() -> list[str]:
    """The names stack.py starts with restarts (read from its source: starting them needs
    the whole stack)."""
    source = (REPO / "deploy/local/stack.py").read_text()
    return [block.split('"')[1] for block in source.split("stack.start(\n")[1:]
            if "restarts=RESTARTS" in block.split(")  # fmt: skip")[0]]  # fmt: skip


def test_the_sglang_engine_trains_full_weights_and_refuses_lora(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLAWRL_SGLANG_VENV", str(tmp_path / "venv"))
    assert stack.parse_args([]).lora_rank is None
    cpu = stack.parse_args([])
    assert stack.resolve_lora_rank(cpu) is None and cpu.lora_rank == stack.LORA_RANK

    refused = stack.resolve_lora_rank(stack.parse_args(["--engine", "sglang", "--lora-rank", "8"]))
    assert refused is not None and "full weights only" in refused and "needs a GPU" in refused
    missing = stack.resolve_lora_rank(stack.parse_args(["--engine", "sglang"]))
    assert missing is not None and "make setup-sglang" in missing

    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / stack.SGLANG_STAMP).write_text("pins")
    args = stack.parse_args(["--engine", "sglang", "--torch-threads", "1"])
    assert stack.resolve_lora_rank(args) is None and args.lora_rank == 0
    assert "--engine sglang: full fine-tuning" in capsys.readouterr().out
    argv, env = stack.engine_command(args, "smollm2-tiny", 30010)
    assert argv[1:3] == ["--backend", "sglang"] and "--enable-lora" not in argv
    assert env["CLAWRL_SGLANG__PYTHON"] == str(tmp_path / "venv" / "bin" / "python")
    assert "--device" in env["CLAWRL_SGLANG__EXTRA_ARGS"] and env["OMP_NUM_THREADS"] == "1"


def test_per_tenant_mode_and_api_keys_reach_the_processes(monkeypatch, capsys) -> None:
    from clawrl.gateway.settings import GatewaySettings

    args = stack.parse_args(["--tenants", "per_tenant", "--tenant-batch", "6",
                             "--api-key", "tenant-a", "--api-key", "tenant-b"])  # fmt: skip
    assert stack.tenant_env(args) == {
        "CLAWRL_TENANTS__MODE": "per_tenant",
        "CLAWRL_TENANTS__MIN_SAMPLES_PER_STEP": "6",
    }
    # The gateway reads the keys (and the mode) as stack.py hands them over.
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")
    for name, value in {**stack.tenant_env(args), **stack.gateway_env(args)}.items():
        monkeypatch.setenv(name, value)
    settings = GatewaySettings()
    assert settings.api_keys() == ["tenant-a", "tenant-b"]
    assert settings.tenants.per_tenant and settings.tenants.min_samples_per_step == 6
    # Unset flags leave clawrl.toml's settings alone; no keys: an open API.
    plain = stack.parse_args([])
    assert stack.tenant_env(plain) == {} and stack.gateway_env(plain) == {}
    # An adapter per tenant needs LoRA: refused before anything starts.
    assert stack.main(["--tenants", "per_tenant", "--lora-rank", "0"]) == 2
    assert "needs LoRA" in capsys.readouterr().err
