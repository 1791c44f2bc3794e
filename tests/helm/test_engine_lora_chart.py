"""policyEngine.lora: the chart's LoRA values become the engine's LoRA settings, which the
launcher turns into SGLang's LoRA flags; off by default and never on the judge engine."""

from __future__ import annotations

import os

import pytest

from clawrl.engine.launcher import build_argv
from clawrl.engine.settings import EngineSettings
from tests.helm.conftest import CHART, helm, pod_specs, render


def engine_env(objects: list[dict], component: str) -> dict[str, str]:
    for obj in objects:
        for name, spec in pod_specs(obj):
            if name == f"Deployment/clawrl-{component}":
                (container,) = [c for c in spec["containers"] if c["name"] == "engine"]
                return {e["name"]: e["value"] for e in container["env"] if "value" in e}
    raise AssertionError(f"no {component} deployment")


def launcher_argv(env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[str]:
    for name in [n for n in os.environ if n.startswith("CLAWRL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLAWRL_CONFIG", str(tmp_path / "none.toml"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_argv(EngineSettings(), model="/models/policy")


def test_lora_values_become_sglangs_flags(monkeypatch, tmp_path) -> None:
    objects = render(sets=("policyEngine.lora.enabled=true", "policyEngine.lora.maxRank=16",
                           "policyEngine.lora.targetModules={q_proj,v_proj}"))  # fmt: skip
    argv = launcher_argv(engine_env(objects, "policy-engine"), monkeypatch, tmp_path)
    assert "--enable-lora" in argv
    assert argv[argv.index("--max-lora-rank") + 1] == "16"
    at = argv.index("--lora-target-modules")
    assert argv[at + 1 : at + 3] == ["q_proj", "v_proj"]
    assert argv[argv.index("--max-loras-per-batch") + 1] == "8"
    judge = launcher_argv(engine_env(objects, "judge-engine"), monkeypatch, tmp_path)
    assert not [a for a in judge if "lora" in a]


def test_lora_is_off_by_default(default_objects: list[dict]) -> None:
    env = engine_env(default_objects, "policy-engine")
    assert not [name for name in env if "LORA" in name]


def test_the_schema_rejects_a_module_sglang_cannot_adapt() -> None:
    result = helm("template", "clawrl", str(CHART), "--set",
                  "policyEngine.lora.targetModules={lm_head}")  # fmt: skip
    assert result.returncode != 0
    assert "/policyEngine/lora/targetModules/0" in result.stderr, result.stderr
