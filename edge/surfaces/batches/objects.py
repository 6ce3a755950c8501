"""The Batch object and a batch's output lines, in OpenAI's shapes."""

from __future__ import annotations

import time
from typing import Any

from edge.surfaces.batches.dispatch import Answer
from edge.surfaces.shared.ids import new_id

#: The one completion window, and how long it is.
WINDOW = "24h"
WINDOW_S = 24 * 3600
#: The Batch object's timestamp of each status.
STAMPS = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


def new_batch(
    batch_id: str, endpoint: str, input_file_id: str, metadata: dict[str, str] | None, created_at: int
) -> dict[str, Any]:
    """A batch as created: ``validating``, its window ending 24 hours after ``created_at``."""
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": WINDOW,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created_at,
        "in_progress_at": None,
        "expires_at": created_at + WINDOW_S,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


def moved(batch: dict[str, Any], status: str, **fields: Any) -> dict[str, Any]:
    """``batch`` in ``status``, stamped now, with ``fields`` changed."""
    return {**batch, "status": status, STAMPS[status]: int(time.time()), **fields}


def request_counts(counts: dict[str, int]) -> dict[str, int]:
    """``request_counts`` from the lines' statuses (:meth:`BatchStore.counts`): expired lines
    failed; lines skipped by a cancel are in the total only."""
    return {
        "total": sum(counts.values()),
        "completed": counts.get("ok", 0),
        "failed": counts.get("failed", 0) + counts.get("expired", 0),
    }


def answered_line(custom_id: str, answer: Answer) -> dict[str, Any]:
    """The output line of a request that was answered (any status)."""
    response = {"status_code": answer.status, "request_id": answer.request_id, "body": answer.body}
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": response, "error": None}


def unanswered_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """The output line of a request that never ran (its batch expired)."""
    error = {"code": code, "message": message}
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": None, "error": error}
