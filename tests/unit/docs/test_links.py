"""README.md and the docs site's pages: every relative link and image resolves (file and
heading anchor), and the README stays a front door."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.docs.markdown_links import anchors, broken_links, links, slugify

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def test_every_readme_link_resolves() -> None:
    readme = ROOT / "README.md"
    assert list(links(readme.read_text())), "the README links into the docs"
    assert broken_links(readme, ROOT) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_every_docs_link_resolves(page: Path) -> None:
    assert broken_links(page, ROOT) == []


def test_every_docs_link_stays_in_the_site() -> None:
    """MkDocs copies docs/ only: a page linking `../services/...` would break on the site."""
    docs = ROOT / "docs"
    outside = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in PAGES
        for _, target in links(page.read_text())
        if not target.startswith(("http://", "https://", "#"))
        and not (page.parent / target.partition("#")[0]).resolve().is_relative_to(docs)
    ]
    assert outside == []


def test_the_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_anchors_are_made_as_mkdocs_makes_them() -> None:
    assert slugify("Long context (16,384 tokens in `make run`)") == (
        "long-context-16384-tokens-in-make-run"
    )
    assert slugify("Is the judge any good? `clawrl judge-eval`") == (
        "is-the-judge-any-good-clawrl-judge-eval"
    )
    assert slugify("held-out v0 → final") == "held-out-v0-final"
    assert anchors("# A\n## B\n```\n## C\n```\n## B\n") == {"a", "b", "b_1"}


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# Here\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#here) [no file](gone.md) [no heading](there.md#gone)\n"
        "`[in code](gone.md)` [web](https://example.com/x)\n```\n[fenced](gone.md)\n```\n"
    )
    assert broken_links(page, tmp_path) == [
        "page.md:1: gone.md (no such file)",
        "page.md:1: there.md#gone (no such heading)",
    ]
