"""The store's schema as numbered migrations, in the SQL both SQLite and PostgreSQL accept."""

from __future__ import annotations

#: The table that records which migrations ran (one row: the highest applied number).
VERSION_TABLE = "CREATE TABLE IF NOT EXISTS sluice_schema (version INTEGER NOT NULL)"

#: Migration ``n`` (1-based) is ``MIGRATIONS[n - 1]``: statements run in one transaction. Append
#: only; a released migration never changes. Times are Unix milliseconds, JSON is text.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            created_at BIGINT NOT NULL,
            expires_at BIGINT NOT NULL,
            status TEXT NOT NULL,
            background INTEGER NOT NULL,
            lease_until BIGINT NOT NULL,
            size_bytes BIGINT NOT NULL,
            response TEXT NOT NULL,
            input_items TEXT NOT NULL,
            conversation TEXT NOT NULL
        )""",
        "CREATE INDEX responses_expires_at ON responses (expires_at)",
        "CREATE INDEX responses_created_at ON responses (created_at)",
    ),
)
