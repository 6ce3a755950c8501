"""The start-up heap, out of the garbage collector's reach once a service is ready.

Notes: docs/shared.md."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from typing import NoReturn

#: Allocations between two collections of the youngest generation once the heap is frozen
#: (CPython's default: 700). Serving keeps many objects for a stream's whole life, which every
#: young collection scans until they are promoted: at 256 streams the default spent about 5 % of
#: the worker's CPU and 7 % of the edge's in the collector, this 1 % and 4.5 % (docs/shared.md).
YOUNG_GENERATION_THRESHOLD = 10_000


def freeze_startup_heap(log: logging.Logger, what: str) -> int:
    """Collects once, then freezes every object alive (modules, the tokenizer, the model's Python
    objects): later full collections scan only what serving allocates instead of stopping the
    process for a few hundred ms over the loaded heap. Young collections then come every
    :data:`YOUNG_GENERATION_THRESHOLD` allocations. Unfrozen at exit, so shutdown collects it as
    before. Logs and returns the count frozen."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, middle, old)
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects from start-up left out of garbage collection", what, frozen)
    return frozen


def exit_without_collecting(code: int) -> NoReturn:
    """Ends the process as the interpreter's exit would (``atexit`` hooks, logging and the standard
    streams flushed) but without its teardown, which collects the whole unfrozen start-up heap
    several times over: seconds of CPU in a loaded worker, for memory the OS takes back anyway."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
