"""``make compiled``: compiles the worker's per-token modules (:data:`sluice.compiled.MODULES`) to C
with mypyc, in place, and records their sources' hashes; ``--clean`` removes what a build left.

Run from the repository's root: ``python -m tools.compile [--clean]``. Notes: docs/shared.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sluice.compiled import MODULES, ROOT, STAMP, extension_of, source_hash


def clean() -> list[str]:
    """Removes the compiled modules, mypyc's shared library and the build's record."""
    removed = []
    for name in MODULES:
        extension = extension_of(ROOT / name)
        if extension is not None:
            extension.unlink()
            removed.append(str(extension.relative_to(ROOT)))
    for library in ROOT.glob("*__mypyc.*"):
        library.unlink()
        removed.append(library.name)
    STAMP.unlink(missing_ok=True)
    return removed


def build() -> None:
    """Compiles :data:`MODULES` in place (type-checked by mypy first, as mypyc requires)."""
    from mypyc.build import mypycify
    from setuptools import setup

    clean()
    hashes = {name: source_hash(ROOT / name) for name in MODULES}  # before: an edit meanwhile is stale
    os.chdir(ROOT)
    setup(
        name="sluice-compiled",
        ext_modules=mypycify(list(MODULES), opt_level="3", target_dir="build/mypyc"),
        script_args=["--quiet", "build_ext", "--inplace", "--build-temp", "build/mypyc-temp"],
    )
    STAMP.parent.mkdir(exist_ok=True)
    STAMP.write_text(json.dumps(hashes, indent=1) + "\n")
    print(f"compiled {len(MODULES)} modules; `make clean-compiled` runs them from source again")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="remove what a build left")
    args = parser.parse_args()
    if args.clean:
        removed = clean()
        print(f"removed {len(removed)} compiled files" if removed else "nothing compiled to remove")
        return 0
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
