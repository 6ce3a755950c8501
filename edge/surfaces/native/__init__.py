"""The native API: ``POST /api/v1/chat`` and ``GET /api/v1/models``."""
