"""Regenerate the committed Python stubs from protos/sluice/v1/*.proto.

Usage: ``python protos/generate.py [OUT_DIR]`` (default: the repository root,
so the stubs land in ``sluice/v1/``). The test suite runs this into a
temporary folder and fails when the committed stubs differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "sluice" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every proto file; returns the generated files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_dir / "sluice" / "v1").iterdir() if p.name.endswith(GENERATED_SUFFIXES))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(target):
        print(path)
