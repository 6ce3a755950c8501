"""The one maker of the ids the edge gives its answers and their parts."""

from __future__ import annotations

import uuid


def new_id(prefix: str, separator: str = "_") -> str:
    """``<prefix><separator><24 hex>``: ``chatcmpl-…``, ``cmpl-…``, ``resp_…``, ``msg_…``,
    ``toolu_…``, ``rs_…``, ``fc_…``; ``call_…`` is also the worker's tool-call id format
    (:func:`sluice.ids.new_tool_call_id`)."""
    return f"{prefix}{separator}{uuid.uuid4().hex[:24]}"
