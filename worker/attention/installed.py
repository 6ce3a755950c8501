"""A value installed per thread for the code run inside a ``with`` block: the step a forward runs in
(:data:`worker.attention.paged.STEP`, :data:`worker.model.recurrent.STATES`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Installed(threading.local, Generic[T]):
    """``value`` while :meth:`using` is open, in the thread that opened it: the engine's thread runs
    one forward at a time, and a forward in any other thread (tensor-parallel ranks run as threads in
    tests, a model's own ``generate`` beside a running engine) sees its own value, not the engine's.
    As a module global, two threads' interleaved blocks could leave one's step installed for good."""

    value: T | None = None

    @contextlib.contextmanager
    def using(self, value: T | None) -> Iterator[None]:
        """Installs ``value`` inside the block (None: leaves what is installed)."""
        previous = self.value
        if value is not None:
            self.value = value
        try:
            yield
        finally:
            self.value = previous
