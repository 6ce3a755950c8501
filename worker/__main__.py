"""``python -m worker`` / ``sluice-worker``: serve one model over gRPC."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from sluice.logs import configure_logging
from worker.config import parse_config
from worker.server import run


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_format, worker_id=config.resolved_worker_id)
    return asyncio.run(run(config))


if __name__ == "__main__":
    sys.exit(main())
