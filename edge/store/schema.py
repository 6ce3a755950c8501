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
    (
        # The Batch API: uploaded and produced files (their JSONL content as text), batches (the
        # Batch object as answered), and each batch's lines with their claims and results.
        """CREATE TABLE files (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            created_at BIGINT NOT NULL,
            expires_at BIGINT NOT NULL,
            purpose TEXT NOT NULL,
            filename TEXT NOT NULL,
            bytes BIGINT NOT NULL,
            content TEXT NOT NULL
        )""",
        "CREATE INDEX files_owner ON files (owner, created_at)",
        """CREATE TABLE batches (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            created_at BIGINT NOT NULL,
            expires_at BIGINT NOT NULL,
            status TEXT NOT NULL,
            lease_until BIGINT NOT NULL,
            batch TEXT NOT NULL
        )""",
        "CREATE INDEX batches_owner ON batches (owner, created_at)",
        "CREATE INDEX batches_status ON batches (status)",
        """CREATE TABLE batch_lines (
            batch_id TEXT NOT NULL,
            line INTEGER NOT NULL,
            custom_id TEXT NOT NULL,
            body TEXT NOT NULL,
            status TEXT NOT NULL,
            claim TEXT NOT NULL,
            lease_until BIGINT NOT NULL,
            ok INTEGER NOT NULL,
            result TEXT NOT NULL,
            PRIMARY KEY (batch_id, line)
        )""",
        "CREATE INDEX batch_lines_status ON batch_lines (batch_id, status)",
    ),
    (
        # Background responses re-run after their edge stopped: the request as sent, how many
        # times an edge took one over, and the index the takeover's search reads.
        "ALTER TABLE responses ADD COLUMN request TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE responses ADD COLUMN reruns INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX responses_running ON responses (status, lease_until)",
    ),
    (
        # The events of a background response streamed as it runs (``stream: true``), numbered
        # by their ``sequence_number``: a client reconnects with ``starting_after``.
        """CREATE TABLE response_events (
            response_id TEXT NOT NULL,
            seq INTEGER NOT NULL,
            event TEXT NOT NULL,
            PRIMARY KEY (response_id, seq)
        )""",
    ),
    (
        # Conversations: their metadata, and their items in order (a position per item, its id
        # unique in the conversation), appended to by each response that names the conversation.
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            created_at BIGINT NOT NULL,
            expires_at BIGINT NOT NULL,
            metadata TEXT NOT NULL
        )""",
        "CREATE INDEX conversations_expires_at ON conversations (expires_at)",
        """CREATE TABLE conversation_items (
            conversation_id TEXT NOT NULL,
            position BIGINT NOT NULL,
            id TEXT NOT NULL,
            item TEXT NOT NULL,
            PRIMARY KEY (conversation_id, position)
        )""",
        "CREATE UNIQUE INDEX conversation_items_id ON conversation_items (conversation_id, id)",
    ),
    (
        # Conversations (their metadata, each item) and stream events count against
        # --state-max-bytes like responses: each row's JSON bytes. Rows written before are
        # counted by their length in characters (the same for ASCII).
        "ALTER TABLE conversations ADD COLUMN size_bytes BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE conversation_items ADD COLUMN size_bytes BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE response_events ADD COLUMN size_bytes BIGINT NOT NULL DEFAULT 0",
        "UPDATE conversations SET size_bytes = LENGTH(metadata)",
        "UPDATE conversation_items SET size_bytes = LENGTH(item)",
        "UPDATE response_events SET size_bytes = LENGTH(event)",
    ),
)
