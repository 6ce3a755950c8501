"""Pages of items with ids, as OpenAI's item lists answer them (``limit``, ``order``, ``after``)."""

from __future__ import annotations

from typing import Any

from edge.requests.validation import bad

# The query parameters of a page (:func:`item_page`), as the OpenAPI document describes them.
PAGE_QUERY = {
    "limit": "Items per page, 1-100 (20).",
    "order": "`desc` (the default: last first) or `asc`.",
    "after": "An item id: the page starts after it.",
}


def item_page(
    items: list[dict[str, Any]], limit: str | None, order: str | None, after: str | None
) -> dict[str, Any]:
    """One page of ``items`` (each with an ``id``) as OpenAI lists them (a stored response's input
    items, a conversation's items); a 400 naming a bad query parameter."""
    try:
        size = 20 if limit is None else int(limit)
    except ValueError:
        raise bad("limit", f"must be an integer, got {limit!r}") from None
    if not 1 <= size <= 100:
        raise bad("limit", f"must be in 1..100, got {size}")
    if order not in (None, "asc", "desc"):
        raise bad("order", f"must be 'asc' or 'desc', got {order!r}")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad("after", f"no item has the id {after!r}")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:size]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > size,
    }
