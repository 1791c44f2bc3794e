"""Install the checkov scanner (PyPI, pinned) into a virtual environment of its own in the cache
directory and print the path of its `checkov` executable. Its many pinned dependencies never
touch the project's .venv. Idempotent: an existing install of the same version is reused.

usage: python scripts/install-checkov.py [VENV_DIR]   (default: $XDG_CACHE_HOME/clawrl/checkov-venv)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "3.3.30"


def main() -> None:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = Path(sys.argv[1]) if len(sys.argv) > 1 else cache / "clawrl" / "checkov-venv"
    checkov = venv / "bin" / "checkov"
    stamp = venv / ".clawrl-checkov-version"
    if not (checkov.is_file() and stamp.is_file() and stamp.read_text().strip() == VERSION):
        # A half-made or other-version venv is rebuilt from scratch, so no stale pins remain.
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [
                str(venv / "bin" / "python"),
                *("-m", "pip", "install", "-q", "--disable-pip-version-check"),
                f"checkov=={VERSION}",
            ],
            check=True,
            stdout=sys.stderr,
        )
        stamp.write_text(VERSION + "\n")
    print(checkov)


if __name__ == "__main__":
    main()
