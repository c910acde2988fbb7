"""Every relative link in the README and in ``docs/*.md`` points at a file of the repository, and
a link to a heading (``page.md#anchor``) at a heading that page has, as GitHub names it."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", flags=re.MULTILINE)


def prose(text: str) -> str:
    """``text`` without code, where a ``](...)`` is an example rather than a link."""
    return CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces as
    hyphens, and ``-1``, ``-2``... after a repeated one."""
    seen: Counter[str] = Counter()
    found = set()
    for title in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        missing = not file.exists()
        if missing or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    return broken


def test_anchors_are_named_as_github_names_them() -> None:
    assert {"streams-that-survive-a-dying-backend", "every-core-of-a-host---workers"} <= anchors(
        ROOT / "docs" / "operations.md"
    ) | anchors(ROOT / "docs" / "workers.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []
