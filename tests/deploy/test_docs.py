"""The README stays a front page, and every relative link in it and in docs/
leads to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The README is what a newcomer reads first; the rest lives in docs/.
README_MAX_LINES = 300


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines: move sections to docs/"


def test_every_relative_link_leads_to_a_file():
    broken = []
    for document in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text()):
            if "://" not in target and not (document.parent / target).exists():
                broken.append(f"{document.relative_to(ROOT)} -> {target}")
    assert broken == []
