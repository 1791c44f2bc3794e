"""The committed generated code is what `make proto` makes from proto/ today."""

from pathlib import Path

from clawrl.common import protogen


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    fresh = {path.name: path.read_text() for path in protogen.generate(tmp_path / "proto")}
    committed = {
        path.name: path.read_text() for path in protogen.PACKAGE_DIR.iterdir() if path.is_file()
    }
    assert sorted(fresh) == sorted(committed), (
        "run `make proto`: the set of generated files changed"
    )
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run `make proto`: {stale} differ from proto/"
