"""The links of a markdown file and the anchors its headings make, as MkDocs (Python-Markdown's
toc) makes them, so README and docs links can be checked without building the site."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, CODE_SPAN.sub("``", line)


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline link and image outside code."""
    for number, line in prose_lines(text):
        for match in LINK.finditer(line):
            yield number, match.group(1)


def slugify(heading: str) -> str:
    """Python-Markdown's toc slug of a heading's text (markup dropped, as in the rendered text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page (a repeated heading gets `_1`, `_2`, ... as in the toc)."""
    seen: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            slug = base = slugify(match.group(2))
            count = 0
            while slug in seen:
                count += 1
                slug = f"{base}_{count}"
            seen.add(slug)
    return seen


def broken_links(page: Path, root: Path) -> list[str]:
    """`file:line: target (why)` for each relative link of a page that does not resolve."""
    broken = []
    text = page.read_text()
    for number, target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not resolved.is_relative_to(root):
            broken.append(f"{where} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{where} (no such file)")
        elif (
            fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text())
        ):
            broken.append(f"{where} (no such heading)")
    return broken
