"""A follower rank's process (``python -m worker.parallel.follower``, started by rank 0): its
settings and place on standard input; it loads its shard and runs rank 0's forwards until told to
stop or rank 0 is gone. Design notes: docs/worker.md, "Tensor parallelism"."""

from __future__ import annotations

import logging
import pickle
import signal
import sys

import torch

from sluice.logs import configure_logging
from worker.config import WorkerConfig
from worker.model.device import RankFailure
from worker.model.loader import ModelLoadError, resolve_device
from worker.parallel.group import Layout, RankGroup
from worker.parallel.ranks import follow, rank_device, sharded_runner

log = logging.getLogger(__name__)


def run(config: WorkerConfig, layout: Layout) -> int:
    """Joins the ranks, loads this rank's shard and follows rank 0; the exit status (0: told to
    stop; 1: rank 0 is gone, or loading failed)."""
    configure_logging(
        config.log_level, config.log_format, worker_id=f"{config.resolved_worker_id}/rank{layout.rank}"
    )
    # Signals are rank 0's to handle: it drains, then stops the followers (or its end ends them).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    group = RankGroup(layout, resolve_device(rank_device(config.device, layout.local_rank)))
    try:
        _loaded, runner, _limits = sharded_runner(config, group)
        follow(group, runner)
    except ModelLoadError as error:
        log.error("tensor-parallel rank %d: %s", layout.rank, error.message)
        return 1
    except RankFailure as error:
        log.warning("tensor-parallel rank %d stops: %s", layout.rank, error)
        return 1
    finally:
        group.close()
    log.info("tensor-parallel rank %d stopped", layout.rank)
    return 0


def main() -> None:
    config, layout = pickle.load(sys.stdin.buffer)
    sys.exit(run(config, layout))


if __name__ == "__main__":
    main()
