"""The README and the pages of docs/, as the tests read their examples."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def page(name: str) -> str:
    """README.md, or a page of docs/ by its file name (models.md)."""
    return (ROOT / name if name == "README.md" else ROOT / "docs" / name).read_text()


def section(text: str, heading: str) -> str:
    """The section whose heading starts with `heading`, up to the next heading of its level or above."""
    found = re.search(rf"^(#+) {re.escape(heading)}.*$", text, flags=re.M)
    assert found, f"no section '{heading}'"
    level = len(found.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[found.end() :], flags=re.M)
    return text[found.start() : found.end() + end.start()] if end else text[found.start() :]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)
