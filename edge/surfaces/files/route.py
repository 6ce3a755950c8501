"""``/v1/files``: upload (multipart, ``purpose: batch``, at most ``--max-file-bytes``), list,
retrieve, read and delete the caller's files; a batch's output and error files are read here too."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from quart import Blueprint, request
from quart.wrappers import Response
from werkzeug.exceptions import RequestEntityTooLarge

from edge.auth import caller_key_id
from edge.errors import InvalidRequestError, NotFoundError
from edge.http import json_response
from edge.openapi import BEARER, Read, documented, schema_ref
from edge.requests.errors import ErrorResponse
from edge.requests.validation import bad
from edge.state import current_state
from edge.store.files import StoredFile
from edge.surfaces.files.models import FileDeleted, FileList, FileObject, FileUploadRequest
from edge.surfaces.shared.ids import new_id

blueprint = Blueprint("files", __name__)
_ID = {"file_id": "The file's id (`file-...`)."}
_STATUSES = ("400", "401", "404")
# Room for the multipart framing around the file itself.
_FORM_SLACK = 64 * 1024


@dataclass(frozen=True)
class _Upload:
    """The upload's operation: a multipart form in, a File object out."""

    summary: str

    def operation(self) -> dict[str, Any]:
        ok = {
            "description": "The stored file.",
            "content": {"application/json": {"schema": schema_ref(FileObject)}},
        }
        error = {
            "description": "An error.",
            "content": {"application/json": {"schema": schema_ref(ErrorResponse)}},
        }
        return {
            "summary": self.summary,
            "security": [{scheme: []} for scheme in BEARER],
            "requestBody": {
                "required": True,
                "content": {"multipart/form-data": {"schema": schema_ref(FileUploadRequest)}},
            },
            "responses": {"200": ok, "400": error, "401": error},
        }

    def models(self) -> tuple[type[BaseModel], ...]:
        return (FileUploadRequest, FileObject, ErrorResponse)


@blueprint.post("/v1/files")
@documented(_Upload("Uploads a batch's JSONL input (multipart: `file`, `purpose: batch`)"))
async def upload_file() -> Response:
    limit = current_state().settings.max_file_bytes
    request.max_content_length = limit + _FORM_SLACK
    try:
        form, files = await request.form, await request.files
    except RequestEntityTooLarge:
        raise _too_large(limit) from None
    if form.get("purpose") != "batch":
        raise bad("purpose", f"only 'batch' is supported, got {form.get('purpose')!r}")
    upload = files.get("file")
    if upload is None:
        raise InvalidRequestError(
            "The form has no 'file' part.", param="file", code="missing_required_parameter"
        )
    data = upload.read()
    if len(data) > limit:
        raise _too_large(limit)
    try:
        content = data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("file", "a batch file must be UTF-8 JSONL") from None
    store = await current_state().store.files()
    stored = StoredFile(
        new_id("file", "-"),
        caller_key_id(),
        int(time.time()),
        store.expiry(),
        "batch",
        upload.filename or "upload.jsonl",
        len(data),
    )
    await store.put(stored, content)
    return json_response(stored.object())


def _too_large(limit: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"The file is larger than this server's limit of {limit} bytes (--max-file-bytes).",
        param="file",
        code="file_too_large",
    )


@blueprint.get("/v1/files")
@documented(
    Read(
        "The caller's files, newest first, a page at a time",
        FileList,
        "A page of files.",
        ("400", "401"),
        query_parameters={
            "purpose": "Only files of this purpose (`batch`, `batch_output`).",
            "limit": "Files per page, 1-10000 (10000).",
            "order": "`desc` (the default: newest first) or `asc`.",
            "after": "A file id: the page starts after it.",
        },
    )
)
async def list_files() -> Response:
    files = await (await current_state().store.files()).owned(caller_key_id(), request.args.get("purpose"))
    objects = [file.object() for file in files]
    if request.args.get("order") == "asc":
        objects.reverse()
    elif request.args.get("order") not in (None, "desc"):
        raise bad("order", f"must be 'asc' or 'desc', got {request.args.get('order')!r}")
    return json_response(page(objects, request.args.get("after"), request.args.get("limit"), 10000))


def page(objects: list[dict[str, Any]], after: str | None, limit: str | None, most: int) -> dict[str, Any]:
    """One page of ``objects`` (in order) after the one whose id is ``after``."""
    try:
        size = most if limit is None else int(limit)
    except ValueError:
        raise bad("limit", f"must be an integer, got {limit!r}") from None
    if not 1 <= size <= most:
        raise bad("limit", f"must be in 1..{most}, got {size}")
    ids = [item["id"] for item in objects]
    rest = objects[ids.index(after) + 1 :] if after in ids else objects if after is None else []
    data = rest[:size]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(rest) > size,
    }


@blueprint.get("/v1/files/<file_id>")
@documented(Read("A file's metadata", FileObject, "The file.", _STATUSES, path_parameters=_ID))
async def retrieve_file(file_id: str) -> Response:
    stored = await (await current_state().store.files()).get(file_id, caller_key_id())
    if stored is None:
        raise _not_found(file_id)
    return json_response(stored.object())


@dataclass(frozen=True)
class _Content:
    """The content's operation: the file's bytes as uploaded or written."""

    def operation(self) -> dict[str, Any]:
        operation = Read("A file's content", FileObject, "", _STATUSES, path_parameters=_ID).operation()
        operation["summary"] = "A file's content (JSONL)"
        operation["responses"]["200"] = {
            "description": "The file's bytes.",
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        }
        return operation

    def models(self) -> tuple[type[BaseModel], ...]:
        return (ErrorResponse,)


@blueprint.get("/v1/files/<file_id>/content")
@documented(_Content())
async def file_content(file_id: str) -> Response:
    content = await (await current_state().store.files()).content(file_id, caller_key_id())
    if content is None:
        raise _not_found(file_id)
    return Response(content.encode("utf-8"), content_type="application/octet-stream")


@blueprint.delete("/v1/files/<file_id>")
@documented(Read("Deletes a file", FileDeleted, "It was deleted.", _STATUSES, path_parameters=_ID))
async def delete_file(file_id: str) -> Response:
    if not await (await current_state().store.files()).delete(file_id, caller_key_id()):
        raise _not_found(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


def _not_found(file_id: str) -> NotFoundError:
    return NotFoundError(f"No such File object: {file_id}", param="file_id")
