"""Identifiers both services make, in one place so their formats agree."""

from __future__ import annotations

import uuid


def new_tool_call_id() -> str:
    """A tool call's id, OpenAI's shape: ``call_`` and 24 hex characters."""
    return f"call_{uuid.uuid4().hex[:24]}"
