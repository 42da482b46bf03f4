"""The documentation stays true to the code: the configuration reference is the
settings declaration's, every relative link resolves, the README stays short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollen.reference import MARKER, generated_part, render
from pollen.settings import Settings
from tests.conftest import PROJECT

PAGES = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
REGENERATE = ".venv/bin/python -m pollen.reference --write docs/configuration.md"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> Iterator[str]:
    """The lines of a Markdown page outside fenced code blocks, with inline
    code spans removed (neither holds links or headings)."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield re.sub(r"`[^`]*`", "", line)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings (lower case, punctuation dropped,
    spaces to hyphens, "-1", "-2", ... for repeats)."""
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_configuration_reference_is_generated_from_the_settings() -> None:
    page = PROJECT / "docs" / "configuration.md"
    generated = generated_part(page.read_text())
    assert generated is not None, f"{page} lacks the line {MARKER!r}"
    assert generated == render(), (
        f"docs/configuration.md differs from the settings declaration: run {REGENERATE}"
    )


def test_the_reference_has_a_row_for_every_key() -> None:
    rows = render().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == [k for k, *_ in Settings.describe()]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(PROJECT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall("\n".join(_prose(page.read_text()))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.name})")
    assert not broken, f"{page.name}: broken links {broken}"


def test_readme_fits_on_a_few_screens() -> None:
    lines = (PROJECT / "README.md").read_text().count("\n")
    assert lines < 200, f"README.md has {lines} lines; move detail to docs/"


def test_the_documentation_site_builds_without_a_warning(tmp_path: Path) -> None:
    """`make docs`: MkDocs (Material theme) in strict mode, so a page outside
    the navigation, a broken link or a link out of docs/ fails the suite."""
    nav = set(
        re.findall(r":\s*(\S+\.md)\s*$", (PROJECT / "mkdocs.yml").read_text(), re.M)
    )
    missing = [p.name for p in (PROJECT / "docs").glob("*.md") if p.name not in nav]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
         "-f", str(PROJECT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
