"""scripts/gpu/pack.py: the bundle for a GPU machine holds what a run imports and the image
lacks, at this venv's versions, and splits into parts that each fit one device call."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def load_pack():
    spec = importlib.util.spec_from_file_location("gpu_pack", REPO / "scripts/gpu/pack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_closure_is_what_a_run_needs_beyond_the_image() -> None:
    closure = load_pack().runtime_closure()
    # The trainer's Ray, the gateway's server, Redis' client, the engine's GGUF reader, and
    # what they need in turn (pydantic's core under pydantic-settings).
    needed = ("ray", "fastapi", "uvicorn", "redis", "gguf", "pydantic-settings", "pydantic-core")
    for name in needed:
        assert closure[name] == md.version(name)
    assert "torch" not in closure and "transformers" not in closure  # the image's own
    assert not [name for name in closure if name.startswith("clawrl-")]  # the tree travels


def test_parts_join_back_to_the_bundle(tmp_path: Path, monkeypatch) -> None:
    pack = load_pack()
    monkeypatch.setattr(pack, "OUT", tmp_path)
    bundle = tmp_path / "bundle.tar"
    bundle.write_bytes(bytes(range(256)) * 41)  # 10,496 bytes
    parts = pack.split(bundle, 4096)
    assert [p.name for p in parts] == ["part.00", "part.01", "part.02"]
    assert b"".join(p.read_bytes() for p in parts) == bundle.read_bytes()
