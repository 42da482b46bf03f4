"""The documentation stays true to the code and readable by a newcomer: the
configuration and command-line references and the results are generated,
every relative link resolves, user pages hold current facts only (their
history is in docs/lab-notes/), and the README stays short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollen.pages import MARKER, README_END, README_START, pages
from pollen.reference import render
from pollen.settings import Settings
from tests.conftest import PROJECT

DOCS = PROJECT / "docs"
PAGES = [PROJECT / "README.md", *sorted(DOCS.rglob("*.md"))]
LAB_NOTES = DOCS / "lab-notes"
# what a user page must not hold: the lab notebook's marks
MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*"
NOT_ON_A_USER_PAGE = {
    "a dated heading": re.compile(
        rf"^#+ .*(?:\b20\d\d-\d\d-\d\d|\b\d{{1,2}} {MONTH} 20\d\d|{MONTH} \d{{1,2}},? 20\d\d)",
        re.M,
    ),
    # hex with a letter and a digit, short or full (ed25519, a key type, is a word)
    "a commit hash": re.compile(
        r"\b(?!ed25519\b)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
    ),
    # "issue 46", "issues 46 and 47" (not "issues 2 requests")
    "an issue number": re.compile(
        r"\bissue #?\d+\b|\bissues #?\d+(?:,| and| or)", re.I
    ),
    "a seed document's name": re.compile(r"\bseed 00\d", re.I),
}
README_LINES = 150
PITCH_WORDS = 50
RESULT_ROWS = 10
CELL_CHARACTERS = 90  # a cell's text (a link's target not counted): one line
REGENERATE = ".venv/bin/python -m pollen.pages --write"
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
    _, marker, generated = page.read_text().partition(MARKER)
    assert marker, f"{page} lacks the line {MARKER!r}"
    assert generated.strip("\n") + "\n" == render(), (
        f"docs/configuration.md differs from the settings declaration: run {REGENERATE}"
    )


def test_the_generated_pages_are_what_their_sources_render() -> None:
    """docs/configuration.md (the settings), docs/cli.md (the parsers),
    docs/results.md and the README's results table
    (benchmarks/measured/*.json)."""
    stale = [p.name for p, text in pages().items() if p.read_text() != text]
    assert not stale, f"{stale} differ: run {REGENERATE}"


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


def user_pages() -> list[Path]:
    """README.md, every page of docs/ but the lab notes, and the tutorials."""
    tutorials = sorted((DOCS / "tutorials").glob("*.py"))
    return [p for p in PAGES if LAB_NOTES not in p.parents] + tutorials


@pytest.mark.parametrize(
    "page", user_pages(), ids=lambda p: p.relative_to(PROJECT).as_posix()
)
def test_a_user_page_states_current_facts_without_the_lab_notebooks_marks(
    page: Path,
) -> None:
    """Dated headings, commit hashes, issue numbers and the seed documents'
    names belong to docs/lab-notes/; a user names a setting by what it is."""
    text = page.read_text()
    found = [f"{what}: {m.group(0)!r} (line {text.count(chr(10), 0, m.start()) + 1})"
             for what, pattern in NOT_ON_A_USER_PAGE.items()
             for m in pattern.finditer(text)]  # fmt: skip
    assert not found, f"{page.name} holds {found}; move history to docs/lab-notes/"


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("## Start-up (2026-11-22)\n", {"a dated heading"}),
        ("Measured on 2026-11-22: `benchmarks/x.py`\n", set()),
        ("before d54d1a4 it diverged", {"a commit hash"}),
        ("## Start-up (22 November 2026)", {"a dated heading"}),
        ("a 1024000 example cache, the word facade, an ed25519 key", set()),
        ("at 3f2a9c1e0b7d4a6c8e5f1a2b3c4d5e6f7a8b9c0d", {"a commit hash"}),
        ("as issue 46 asked", {"an issue number"}),
        ("issues 12 and 13", {"an issue number"}),
        ("each SuperNode issues 2 requests a round", set()),
        ("Seed 003's setting; seed 845", {"a seed document's name"}),
    ],
)
def test_the_lab_notebooks_marks_are_recognised(text: str, found: set[str]) -> None:
    assert {w for w, p in NOT_ON_A_USER_PAGE.items() if p.search(text)} == found


def test_the_readme_is_short_its_pitch_short_its_results_one_line_each() -> None:
    text = (PROJECT / "README.md").read_text()
    lines = text.count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines; move detail to docs/"
    pitch = text.split("\n\n")[1]  # the paragraph under the title
    assert len(pitch.split()) <= PITCH_WORDS, pitch
    table = text.split(README_START)[1].split(README_END)[0]
    results = [line for line in table.splitlines() if line.startswith("|")][2:]
    assert 0 < len(results) <= RESULT_ROWS, results
    for row in results:
        for cell in row.strip("|").split("|"):
            shown = re.sub(r"\]\([^)]*\)", "]", cell).strip()
            assert len(shown) <= CELL_CHARACTERS, (
                f"a README cell over one line: {shown}"
            )


def test_the_documentation_site_builds_without_a_warning(tmp_path: Path) -> None:
    """`make docs`: MkDocs (Material theme) in strict mode, so a page outside
    the navigation, a broken link or a link out of docs/ fails the suite."""
    nav = set(
        re.findall(r":\s*(\S+\.md)\s*$", (PROJECT / "mkdocs.yml").read_text(), re.M)
    )
    missing = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")
               if p.relative_to(DOCS).as_posix() not in nav]  # fmt: skip
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
         "-f", str(PROJECT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
