"""Continuous batching: the step loop (``core.py``: schedule, execute, ``update.py``), the scheduler
and KV block bookkeeping, and each request's way in (``prepare.py``) and out (``sink.py``,
``request_stream.py``)."""
