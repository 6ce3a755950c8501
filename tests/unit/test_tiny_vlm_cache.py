"""The tiny vision-language checkpoints' cache (``tests/tiny_vlms.py``): a checkpoint is built once
and read after, built again when what it is made of changes (a template, say), and another key's
checkpoint unused for a day is removed. The builder is faked: nothing is built here."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests import tiny_vlms


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    made: list[Path] = []

    def build(arch: str, folder: Path) -> Path:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(f'{{"arch": "{arch}"}}')
        made.append(folder)
        return folder

    monkeypatch.setattr(tiny_vlms, "build_tiny_vlm", build)
    return made


def test_a_checkpoint_is_built_once_then_read_and_built_again_when_a_template_changes(
    builds: list[Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    templates = tmp_path / "templates"
    shutil.copytree(tiny_vlms.TEMPLATES, templates)
    monkeypatch.setattr(tiny_vlms, "TEMPLATES", templates)
    cache = tmp_path / "cache"
    first = tiny_vlms.cached_tiny_vlm("llava", cache)
    assert tiny_vlms.cached_tiny_vlm("llava", cache) == first and builds == [first]
    assert tiny_vlms.cached_tiny_vlm("gemma3", cache) != first  # each architecture its own
    (first / "config.json").unlink()  # an interrupted build: built again
    assert tiny_vlms.cached_tiny_vlm("llava", cache) == first and builds[-1] == first and len(builds) == 3
    template = next(templates.iterdir())
    template.write_text(template.read_text() + " ")
    changed = tiny_vlms.cached_tiny_vlm("llava", cache)
    assert changed != first and builds[-1] == changed
    assert first.is_dir()  # the other key's, used a moment ago, stays


def test_another_keys_checkpoint_unused_for_a_day_is_removed(builds: list[Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stale, recent = cache / "llava-0123456789abcdef", cache / "llava-fedcba9876543210"
    for folder in (stale, recent):
        folder.mkdir(parents=True)
        (cache / f"{folder.name}.done").touch()
    day_ago = time.time() - tiny_vlms.STALE_AFTER_S - 60
    os.utime(cache / f"{stale.name}.done", (day_ago, day_ago))
    kept = tiny_vlms.cached_tiny_vlm("llava", cache)
    assert kept.is_dir() and recent.is_dir() and not stale.exists()
    assert not (cache / f"{stale.name}.done").exists()
