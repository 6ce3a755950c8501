"""Continuous batching: the step loop (``core.py``), the scheduler and KV block bookkeeping, and each
request's way in (``prepare.py``) and out (``request_stream.py``)."""
