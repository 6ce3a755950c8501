"""sluice/compiled.py: which listed modules a build compiled, and the refusal of a stale build."""

from __future__ import annotations

import importlib.machinery
import json
from pathlib import Path

import pytest

from sluice.compiled import MODULES, StaleBuild, built, check_fresh, source_hash

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def tree(tmp_path: Path, compiled: tuple[str, ...]) -> Path:
    """A source tree with every listed module, a (dummy) extension beside ``compiled`` ones and
    the build's record of their hashes."""
    for name in MODULES:
        source = tmp_path / name
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(f"# {name}\n")
    for name in compiled:
        (tmp_path / name).with_suffix(SUFFIX).write_bytes(b"")
    stamp = tmp_path / "build" / "compiled.json"
    stamp.parent.mkdir()
    stamp.write_text(json.dumps({name: source_hash(tmp_path / name) for name in compiled}))
    return tmp_path


def test_a_tree_without_a_build_runs_from_source(tmp_path: Path) -> None:
    root = tree(tmp_path, ())
    assert built(root) == []
    check_fresh(root)


def test_a_fresh_build_passes_and_lists_what_it_compiled(tmp_path: Path) -> None:
    root = tree(tmp_path, MODULES[:2])
    assert built(root) == list(MODULES[:2])
    check_fresh(root)


def test_a_source_edited_after_the_build_is_refused_naming_it(tmp_path: Path) -> None:
    root = tree(tmp_path, MODULES)
    (root / MODULES[1]).write_text("# edited\n")
    with pytest.raises(StaleBuild, match=rf"^{MODULES[1]} changed since `make compiled` built it: run"):
        check_fresh(root)
    (root / MODULES[3]).write_text("# edited too\n")
    with pytest.raises(StaleBuild, match=r"\(and 1 more\)"):
        check_fresh(root)


def test_a_build_without_its_record_is_refused(tmp_path: Path) -> None:
    root = tree(tmp_path, MODULES[:1])
    (root / "build" / "compiled.json").unlink()
    with pytest.raises(StaleBuild, match="make clean-compiled"):
        check_fresh(root)
