"""A batch's input file checked line by line as OpenAI checks it: each line a JSON object with a
unique ``custom_id``, ``method`` POST, the batch's ``url`` and an object ``body`` (not streamed);
every error named with its line number. The body itself is checked when its line runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

#: The endpoints a batch may target.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
#: The most lines a batch may have (OpenAI's limit).
MAX_LINES = 50_000
#: The most errors a failed validation reports.
MAX_ERRORS = 1000


@dataclass(frozen=True)
class BatchLine:
    """One valid line: its ``custom_id`` and the request body it sends."""

    custom_id: str
    body: dict[str, Any]


def line_error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """One entry of a failed batch's ``errors.data``."""
    return {"code": code, "message": message, "param": param, "line": line}


def parse_lines(content: str, endpoint: str) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The file's lines (blank lines skipped, numbers counting every line from 1), and the
    errors that fail the batch (none: the batch runs)."""
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    # Lines end at "\n" (and "\r\n") only: a JSON string may hold U+2028 and the other characters
    # str.splitlines() would also break at.
    for number, text in enumerate(content.split("\n"), 1):
        if not text.strip():
            continue
        parsed = _line(text, number, endpoint)
        if isinstance(parsed, dict):
            errors.append(parsed)
        elif parsed.custom_id in seen:
            message = f"The custom_id '{parsed.custom_id}' is used by an earlier line."
            errors.append(line_error("duplicate_custom_id", message, number, "custom_id"))
        else:
            seen.add(parsed.custom_id)
            lines.append(parsed)
    if not lines and not errors:
        errors.append(line_error("empty_file", "The input file has no requests."))
    if len(lines) > MAX_LINES:
        message = f"The batch has {len(lines)} requests; at most {MAX_LINES} are allowed."
        errors.append(line_error("too_many_requests", message))
    return lines, errors[:MAX_ERRORS]


def _line(text: str, number: int, endpoint: str) -> BatchLine | dict[str, Any]:
    """One line parsed, or its error."""
    try:
        item = orjson.loads(text)
    except orjson.JSONDecodeError:
        return line_error("invalid_json_line", "This line is not valid JSON.", number)
    if not isinstance(item, dict):
        return line_error("invalid_request", "Each line must be a JSON object.", number)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return line_error(
            "missing_required_parameter", "custom_id must be a non-empty string.", number, "custom_id"
        )
    if item.get("method") != "POST":
        return line_error("invalid_method", "method must be 'POST'.", number, "method")
    if item.get("url") != endpoint:
        message = f"url must be the batch's endpoint '{endpoint}', got {item.get('url')!r}."
        return line_error("invalid_url", message, number, "url")
    body = item.get("body")
    if not isinstance(body, dict):
        return line_error("invalid_request", "body must be a JSON object.", number, "body")
    if body.get("stream") not in (None, False):
        return line_error("invalid_request", "A batch request cannot be streamed.", number, "body.stream")
    if body.get("background") not in (None, False):
        message = "A batch request cannot run in the background."
        return line_error("invalid_request", message, number, "body.background")
    return BatchLine(custom_id, body)
