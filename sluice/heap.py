"""The start-up heap, out of the garbage collector's reach once a service is ready.

Notes: docs/shared.md."""

from __future__ import annotations

import atexit
import gc
import logging


def freeze_startup_heap(log: logging.Logger, what: str) -> int:
    """Collects once, then freezes every object alive (modules, the tokenizer, the model's Python
    objects): later full collections scan only what serving allocates instead of stopping the
    process for a few hundred ms over the loaded heap. Unfrozen at exit, so shutdown collects it
    as before. Logs and returns the count frozen."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects from start-up left out of garbage collection", what, frozen)
    return frozen
