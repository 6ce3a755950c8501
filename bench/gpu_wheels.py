"""Puts what the GPU machine lacks into .gpu/ (ignored by git): wheels for its Python 3.12 and the
default model's tokenizer files, so `make gpu-check` runs there from this checkout alone.

Usage::

    python bench/gpu_wheels.py            # make gpu-wheels

The device image (read 2026-11-17) has torch 2.11, triton 3.6, transformers 5.17, grpcio,
protobuf, prometheus-client, httpx, uvloop and pytest (no pillow); the worker and the check also need the
packages in MISSING and NEWER, pinned to the versions installed here. Everything must fit in 64 MiB.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 64 << 20
# What the device image lacks (with the dependencies those bring that it lacks too).
MISSING = (
    "gguf",
    "llguidance",
    "quart",
    "hypercorn",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "orjson",
    "grpcio-health-checking",
    "grpcio-reflection",
    "grpcio-status",
    "googleapis-common-protos",
    "pytest-asyncio",
    "pillow",  # images (worker/prompts/images.py), imported when the worker starts
    # The edge (bench/bench_multiplexed.py on the device): quart's and hypercorn's dependencies, and
    # the store and rate-limit clients edge/app.py imports at start.
    "flask",
    "blinker",
    "itsdangerous",
    "h2",
    "hpack",
    "hyperframe",
    "priority",
    "wsproto",
    "redis",
    "psycopg",
    "psycopg-binary",
)
# What it has at other versions than this code needs: the protobuf and grpcio the committed stubs were
# generated for (their generated code refuses an older runtime), and the transformers the tests here
# ran (with the regex it requires), so the device runs the model code the CPU suite proved.
NEWER = ("protobuf", "grpcio", "transformers", "regex")
# pip matches a manylinux tag's glibc version exactly: every one up to the device's glibc 2.39.
GLIBC_MINORS = (39, 35, 34, 31, 28, 27, 24, 17)
PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in GLIBC_MINORS), "manylinux2014_x86_64")
# Kernel packages, installed apart (gpu_check.KERNEL_SITE) so that only the hybrid steps see them.
KERNELS = ("flash-linear-attention", "fla-core")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "generation_config.json")  # fmt: skip


def pins(names: tuple[str, ...], version: object = importlib.metadata.version) -> list[str]:
    """``name==version`` for each package, at the version installed here (so the device runs what
    the tests here ran); a package not installed here is left unpinned."""
    found = []
    for name in names:
        try:
            found.append(f"{name}=={version(name)}")  # type: ignore[operator]
        except importlib.metadata.PackageNotFoundError:
            found.append(name)
    return found


def download_command(requirements: list[str], folder: Path) -> list[str]:
    """pip's command that downloads exactly ``requirements`` (no dependencies) as CPython 3.12 wheels."""
    platforms = [arg for platform in (*PLATFORMS, "any") for arg in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder),
            *requirements]  # fmt: skip


def total_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / ".gpu")
    args = parser.parse_args()
    wheels, tokenizer, kernels = args.out / "wheels", args.out / "tok", args.out / "kernels"
    for folder in (wheels, kernels):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    tokenizer.mkdir(parents=True, exist_ok=True)
    for requirement, folder in [(r, wheels) for r in pins(MISSING + NEWER)] + [(k, kernels) for k in KERNELS]:
        if subprocess.run(download_command([requirement], folder), check=False).returncode:
            print(f"{requirement}: no wheel for the device's CPython 3.12 on x86-64", file=sys.stderr)
            return 1
    sys.path.insert(0, str(REPO))
    from worker.config import DEFAULT_CACHE_DIR
    from worker.model.loader import converted_gguf_folder, default_gguf_path

    source = converted_gguf_folder(default_gguf_path(), DEFAULT_CACHE_DIR)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, tokenizer / name)
    size = total_bytes(args.out)
    print(f"{args.out}: {len(list(wheels.glob('*.whl')))} wheels and the tokenizer, {size / 2**20:.1f} MiB")
    if size > LIMIT_BYTES:
        print(f"over the {LIMIT_BYTES >> 20} MiB that may travel to the device", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
