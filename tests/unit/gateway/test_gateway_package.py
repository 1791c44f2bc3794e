"""The session scripts are package data: a non-editable install (the Dockerfile's `pip install
services/gateway`) carries them, and the gateway loads them through importlib.resources."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from clawrl.gateway.sessions import SCRIPTS, load_script

REPO = Path(__file__).resolve().parents[3]


def test_the_wheel_carries_every_lua_script(tmp_path):
    # Built from a copy: setuptools writes build/ and egg-info next to the sources.
    source = tmp_path / "gateway"
    shutil.copytree(
        REPO / "services" / "gateway",
        source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        cwd=tmp_path,
    )
    [wheel] = tmp_path.glob("clawrl_gateway-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("common", *SCRIPTS):
        assert f"clawrl/gateway/lua/{name}.lua" in names


def test_each_script_is_the_shared_helpers_and_its_own_body():
    for name in SCRIPTS:
        script = load_script(name)
        assert (
            "local function finalize_pending" in script and "TURN_TYPE = 'clawrl.v1.Turn'" in script
        )
