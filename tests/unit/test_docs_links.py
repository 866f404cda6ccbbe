"""Every link in README.md and docs/ reaches a file of this repository, and every anchor a heading of that file
(issue #49: a link to a file outside the repository, and an anchor no heading had). Pure text, no network: web
links are not followed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: A Markdown link or image: [text](target) or ![alt](target), the target without a title.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The page without its fenced code blocks and inline code (a link there is an example, not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link's text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on ``page`` (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text()).splitlines():
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            count = seen.get(base, 0)
            out.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(page.read_text()))]


def broken(page: Path) -> list[str]:
    """The page's links that reach no file of the repository or no heading of it."""
    out = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not followed
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(REPO) or not dest.exists():
            out.append(f"{target}: no such file in the repository")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            out.append(f"{target}: {dest.relative_to(REPO)} has no heading with that anchor")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_anchor_resolves(page):
    assert broken(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_names_a_path_outside_the_repository(page):
    """A path in code (`../shared/notes/...`, a home or work folder of the machine a page was written on) is a dead
    link for every reader."""
    text = page.read_text()
    outside = [p for p in re.findall(r"`(\.\./[^`\s]+)`", text) if not (page.parent / p).resolve().is_relative_to(REPO)]
    outside += re.findall(r"(?<![\w.])/(?:work|home|Users|root)/[\w./-]+", text)
    assert outside == []


def test_the_checker_sees_what_it_checks():
    """The slug rules on this project's headings, and a page with a bad link and anchor fails."""
    assert slug("Reuse outcomes") == "reuse-outcomes"
    assert slug("On AWS: the deploy and the engine nodes") == "on-aws-the-deploy-and-the-engine-nodes"
    assert slug("Outcome `recompute`: healthy with prefill-cached tokens") == (
        "outcome-recompute-healthy-with-prefill-cached-tokens")
    assert "reuse-outcomes" in anchors(REPO / "README.md")
    assert any("README.md#reuse-outcomes" in t for t in links(REPO / "docs" / "router.md"))
