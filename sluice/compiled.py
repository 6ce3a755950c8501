"""The worker's per-token modules, optionally compiled to C by mypyc (``make compiled``), and the
check that a build is not older than its sources (Python would run the old code).

Notes: docs/shared.md.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import sys
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent

#: The modules a build compiles: the engine's per-row bookkeeping and each step's output processing,
#: where the worker's CPU per streamed token goes (docs/benchmarks.md).
MODULES: Final[tuple[str, ...]] = (
    "worker/engine/update.py",
    "worker/engine/scheduler.py",
    "worker/engine/requests.py",
    "worker/engine/sink.py",
    "worker/engine/kv_blocks.py",
    "worker/sampling/sampler.py",
    "worker/output/processor.py",
    "worker/output/choice_output.py",
    "worker/output/stop_strings.py",
)

#: The build's record: each compiled source's SHA-256 when it was compiled.
STAMP: Final = ROOT / "build" / "compiled.json"


class StaleBuild(ImportError):
    """A compiled module is older than its source."""


def source_hash(path: Path) -> str:
    """What the build records of a source: its SHA-256."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extension_of(source: Path) -> Path | None:
    """The compiled module beside ``source``, if a build left one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = source.with_suffix(suffix)
        if candidate.exists():
            return candidate
    return None


def built(root: Path = ROOT) -> list[str]:
    """The listed modules that have a compiled module beside their source."""
    return [name for name in MODULES if extension_of(root / name) is not None]


def check_fresh(root: Path = ROOT) -> None:
    """Raises :class:`StaleBuild` when a compiled module's source changed since the build (or the
    build's record is missing): Python would run the old code."""
    present = built(root)
    if not present:
        return
    try:
        record = json.loads((root / STAMP.relative_to(ROOT)).read_text())
    except (OSError, ValueError):
        record = {}
    stale = [name for name in present if record.get(name) != source_hash(root / name)]
    if stale:
        raise StaleBuild(
            f"{stale[0]} changed since `make compiled` built it"
            f"{f' (and {len(stale) - 1} more)' if len(stale) > 1 else ''}: "
            "run `make compiled` again, or `make clean-compiled` to run from source"
        )


def running() -> list[str]:
    """The listed modules this process imported from their compiled form (for the start-up log)."""
    names = []
    for name in MODULES:
        module = sys.modules.get(name.removesuffix(".py").replace("/", "."))
        if module is not None and not str(getattr(module, "__file__", "")).endswith(".py"):
            names.append(name)
    return names


def describe() -> str:
    """One line for the start-up log: how many of the listed modules run compiled."""
    compiled = running()
    if not compiled:
        return "from source (`make compiled` compiles them: docs/shared.md)"
    return f"{len(compiled)} of {len(MODULES)} compiled (mypyc)"
