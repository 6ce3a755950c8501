"""The start-up heap, out of the garbage collector's reach once a service is ready.

Notes: docs/shared.md."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from typing import NoReturn


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


def exit_without_collecting(code: int) -> NoReturn:
    """Ends the process as the interpreter's exit would (``atexit`` hooks, logging and the standard
    streams flushed) but without its teardown, which collects the whole unfrozen start-up heap
    several times over: seconds of CPU in a loaded worker, for memory the OS takes back anyway."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
