"""Every relative link in README.md and docs/ points at a file or folder that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(path: Path) -> list[str]:
    """Link targets of a markdown file that are neither URLs nor in-page anchors."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [
        target.split("#", 1)[0]
        for target in LINK.findall(text)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")
    ]


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [
        f"{page.relative_to(ROOT)} -> {target}"
        for page in pages
        for target in relative_links(page)
        if not (page.parent / target).exists()
    ]
    assert len(pages) > 1 and not broken, "\n".join(broken)


def test_the_readme_is_a_front_door():
    """The README stays short; the rest lives in docs/ (12 KB is the agreed limit)."""
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024
