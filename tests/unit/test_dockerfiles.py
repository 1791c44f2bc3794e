"""Every service has a Dockerfile that hadolint (the real binary) passes, runs as non-root, and
installs what its service needs (no torch in the gateway and judge images)."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = sorted(p for p in (REPO / "services").iterdir() if (p / "pyproject.toml").is_file())
# common is a library and the simulator a client-side tool (`clawrl simulate`), not images.
IMAGES = [p for p in SERVICES if p.name not in ("common", "simulator")]


def test_every_service_has_a_dockerfile() -> None:
    missing = [p.name for p in IMAGES if not (p / "Dockerfile").is_file()]
    assert not missing


@pytest.mark.parametrize("service", IMAGES, ids=lambda p: p.name)
def test_hadolint_passes(service: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run(
        [hadolint, str(service / "Dockerfile")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def stages(dockerfile: Path) -> list[list[str]]:
    """The instructions of each build stage (continuation lines joined)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    result: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            result.append([])
        if result:  # ARGs before the first FROM belong to no stage
            result[-1].append(line)
    return result


@pytest.mark.parametrize("service", IMAGES, ids=lambda p: p.name)
def test_every_stage_runs_as_a_non_root_user(service: Path) -> None:
    for stage in stages(service / "Dockerfile"):
        users = [line.split()[1] for line in stage if line.upper().startswith("USER ")]
        assert users, f"{stage[0]}: no USER"
        assert users[-1] not in ("0", "root"), stage[0]


def dependencies(service: str) -> list[str]:
    with (REPO / "services" / service / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


@pytest.mark.parametrize("service", ["gateway", "judge"])
def test_gateway_and_judge_images_need_no_torch(service: str) -> None:
    dockerfile = (REPO / "services" / service / "Dockerfile").read_text()
    installs = " ".join(line for stage in stages(REPO / "services" / service / "Dockerfile")
                        for line in stage if line.upper().startswith("RUN "))  # fmt: skip
    assert "torch" not in installs and "torch" not in dockerfile.split("FROM", 1)[1]
    for package in ("common", service):
        assert not [d for d in dependencies(package) if d.startswith("torch")], package


def test_trainer_image_has_torch_megatron_and_ray() -> None:
    (stage,) = stages(REPO / "services" / "trainer" / "Dockerfile")
    run = " ".join(line for line in stage if line.upper().startswith("RUN "))
    assert "torch==" in run and "ray[default]==" in run and "trainer[megatron]" in run


def settings_class(service: str) -> type:
    from clawrl.engine.settings import EngineSettings
    from clawrl.environments.settings import EnvironmentsSettings
    from clawrl.gateway.settings import GatewaySettings
    from clawrl.judge.settings import JudgeSettings
    from clawrl.trainer.settings import TrainerSettings

    return {
        "environments": EnvironmentsSettings,
        "gateway": GatewaySettings,
        "judge": JudgeSettings,
        "rollout-engine": EngineSettings,
        "trainer": TrainerSettings,
    }[service]


@pytest.mark.parametrize("service", IMAGES, ids=lambda p: p.name)
def test_settings_set_by_an_image_exist(service: Path) -> None:
    """An image's CLAWRL_<SECTION>__<FIELD> names a field its service has (settings ignore
    unknown sections silently, so a renamed section would otherwise go unnoticed)."""
    text = (service / "Dockerfile").read_text()
    names = re.findall(r"\bCLAWRL_([A-Z_]+?)__([A-Z_]+)=", text)
    assert names, "every image sets at least the JSON log format"
    fields = settings_class(service.name).model_fields
    for section, field in names:
        assert section.lower() in fields, f"CLAWRL_{section}__{field}"
        assert field.lower() in fields[section.lower()].annotation.model_fields, field
