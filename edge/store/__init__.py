"""The edge's state store: stored Responses in embedded SQLite (``--state-dir``) or PostgreSQL
(``--state-url``), one schema and migration path for both. docs/operations.md, "State"."""
