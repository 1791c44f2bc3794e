"""Every service has a Dockerfile and hadolint (the real binary) passes it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = sorted(p for p in (REPO / "services").iterdir() if (p / "pyproject.toml").is_file())
IMAGES = [p for p in SERVICES if p.name != "common"]  # common is a library, not an image


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
