"""The playground's shipped files, without a browser: the byte budget of docs/playground.md, no
reference to anything outside the edge, and every file carried by the package data."""

from __future__ import annotations

import fnmatch
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from edge.routes.playground import CONTENT_SECURITY_POLICY, PAGE

REPO = Path(__file__).resolve().parents[2]
STATIC = REPO / "edge" / "static"
SHIPPED = sorted(p for p in STATIC.iterdir() if p.is_file())
BUDGET = re.compile(r"byte budget: \*\*([0-9,]+) bytes\*\*")


def budget_from_docs() -> int:
    match = BUDGET.search((REPO / "docs" / "playground.md").read_text())
    assert match, "docs/playground.md states no byte budget"
    return int(match.group(1).replace(",", ""))


def test_the_page_fits_the_documented_byte_budget() -> None:
    total = sum(p.stat().st_size for p in SHIPPED)
    budget = budget_from_docs()
    print(f"playground: {total} bytes in {len(SHIPPED)} files (budget {budget})")
    assert {p.name for p in SHIPPED} == {PAGE, "playground.js", "playground.css"}
    assert total <= budget


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_no_file_refers_to_another_origin(path: Path) -> None:
    text = path.read_text()
    assert not re.search(r"[a-z][a-z0-9+.-]*://", text, re.IGNORECASE), "an absolute URL"
    assert not re.search(r"(?<![:\w])//[a-z0-9]", text, re.IGNORECASE), "a scheme-relative URL"
    assert "@import" not in text and "url(" not in text


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [value or "" for name, value in attrs if name in ("src", "href", "action")]


def test_the_page_links_only_its_own_files() -> None:
    parser = _Links()
    parser.feed((STATIC / PAGE).read_text())
    for link in parser.links:
        own = link.startswith("static/") and (STATIC / link.removeprefix("static/")).is_file()
        assert own or link.startswith("#") or link == "data:,", link
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY and "connect-src 'self'" in CONTENT_SECURITY_POLICY


def test_package_data_carries_every_file() -> None:
    from setuptools.config.pyprojecttoml import read_configuration

    patterns = read_configuration(REPO / "pyproject.toml")["tool"]["setuptools"]["package-data"]["edge"]
    for path in SHIPPED:
        relative = path.relative_to(REPO / "edge").as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative
