"""Sluice edge: the public OpenAI-compatible HTTP + SSE front of the gRPC workers.

Entry points: :func:`edge.app.create_app` (the Quart app) and ``python -m edge``
(serves it with hypercorn). The wire contract callers see is docs/http.md.
"""
