"""``python -m worker`` / ``sluice-worker``: serve one model over gRPC."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from worker.config import parse_config
from worker.server import run


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return asyncio.run(run(config))


if __name__ == "__main__":
    sys.exit(main())
