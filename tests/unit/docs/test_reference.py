"""The generated references in docs/reference/ are what the code gives today: a setting, a Helm
value or a metric added without `make reference` fails here. The generator itself is checked to
leave nothing out."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SPEC = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts/gen_reference.py")
gen = importlib.util.module_from_spec(SPEC)
sys.modules["gen_reference"] = gen
SPEC.loader.exec_module(gen)


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return gen.render()


@pytest.mark.parametrize("name", sorted(gen.PAGES))
def test_the_committed_reference_is_current(name: str, pages: dict[str, str]) -> None:
    committed = (ROOT / "docs/reference" / name).read_text()
    assert committed == pages[name], f"docs/reference/{name} is stale: run make reference"


def test_every_setting_of_every_service_is_listed(pages: dict[str, str]) -> None:
    page = pages["settings.md"]
    missing = []
    for service, cls in gen.services().items():
        for name, field in cls.model_fields.items():
            section = gen.section_class(field.annotation)
            if section is None:
                env = f"`CLAWRL_{name.upper()}`"
                missing += [f"{service}: {name}"] if env not in page else []
                continue
            for field_name, sub in section.model_fields.items():
                env = f"`CLAWRL_{name.upper()}__{field_name.upper()}`"
                if env not in page or (sub.description and gen.cell(sub.description) not in page):
                    missing.append(f"{service}: {name}.{field_name}")
    assert missing == []


def test_every_helm_value_is_listed(pages: dict[str, str]) -> None:
    schema = json.loads((ROOT / "helm/clawrl/values.schema.json").read_text())

    def leaves(node: dict, path: str) -> list[str]:
        children = gen.resolve(schema, node).get("properties") or {}
        if not children:
            return [path]
        return [p for key, child in children.items() for p in leaves(child, f"{path}.{key}")]

    listed = {
        line.split("`")[1]
        for line in pages["helm-values.md"].splitlines()
        if line.startswith("| `")
    }
    for key, node in schema["properties"].items():
        for path in leaves(node, key):
            # a value is listed itself, or inside the object listed for it
            assert any(path == p or path.startswith(p + ".") for p in listed), path


def test_every_metric_is_listed(pages: dict[str, str]) -> None:
    page = pages["metrics.md"]
    for service, registry in gen.registries().items():
        for family in registry.collect():
            assert f"`{family.name}" in page, f"{service}: {family.name}"


def test_every_documented_value_has_its_comment(pages: dict[str, str]) -> None:
    """A value of values.yaml with no `# --` comment would be listed with no description."""
    undescribed = [
        line.split("`")[1]
        for line in pages["helm-values.md"].splitlines()
        if line.startswith("| `") and line.rstrip().endswith("|  |")
    ]
    assert undescribed == []


def test_a_new_setting_makes_the_page_stale(monkeypatch, pages: dict[str, str]) -> None:
    from pydantic import Field, create_model

    from clawrl.gateway.settings import GatewaySettings, ServingSettings

    grown = create_model(
        "ServingSettings",
        __base__=ServingSettings,
        brand_new_knob=(int, Field(3, description="A setting nobody documented yet.")),
    )
    extended = create_model("GatewaySettings", __base__=GatewaySettings, serving=(grown, grown()))
    monkeypatch.setattr(gen, "services", lambda: {"gateway": extended})
    page = gen.settings_page()
    assert "`CLAWRL_SERVING__BRAND_NEW_KNOB`" in page
    assert page != pages["settings.md"]
