"""``/v1/batches``: create (from an uploaded ``batch`` file), retrieve, list and cancel the
caller's batches; :mod:`edge.surfaces.batches.runner` does the work."""

from __future__ import annotations

from quart import Blueprint, request
from quart.wrappers import Response

from edge.auth import caller_key_id
from edge.errors import InvalidRequestError, NotFoundError
from edge.http import json_response, read_json_body
from edge.openapi import Read, Unary, documented
from edge.requests.validation import bad, validate_body
from edge.state import current_state
from edge.store.batches import BatchRecord, BatchStore
from edge.store.responses import now_ms
from edge.surfaces.batches.models import BatchCreateRequest, BatchList, BatchObject
from edge.surfaces.batches.objects import WINDOW_S, moved, new_batch, request_counts
from edge.surfaces.shared.ids import new_id

blueprint = Blueprint("batches", __name__)
_ID = {"batch_id": "The batch's id (`batch_...`)."}
_STATUSES = ("400", "401", "404")
#: The statuses a cancel applies to.
CANCELLABLE = ("validating", "in_progress")


@blueprint.post("/v1/batches")
@documented(Unary("Creates a batch from an uploaded `batch` file", BatchCreateRequest, BatchObject))
async def create_batch() -> Response:
    body = validate_body(BatchCreateRequest, await read_json_body())
    owner = caller_key_id()
    state = current_state()
    source = await (await state.store.files()).get(body.input_file_id, owner)
    if source is None or source.purpose != "batch":
        raise bad("input_file_id", f"no file with purpose 'batch' has the id {body.input_file_id!r}")
    created = now_ms()
    batch_id = new_id("batch")
    batch = new_batch(batch_id, body.endpoint, body.input_file_id, body.metadata, created // 1000)
    record = BatchRecord(batch_id, owner, created, created + WINDOW_S * 1000, "validating", 0, batch)
    await (await state.store.batches()).create(record)
    return json_response(batch)


@blueprint.get("/v1/batches/<batch_id>")
@documented(
    Read(
        "A batch (poll it until its status is final)",
        BatchObject,
        "The batch.",
        _STATUSES,
        path_parameters=_ID,
    )
)
async def retrieve_batch(batch_id: str) -> Response:
    store = await current_state().store.batches()
    return json_response(await _current(store, await _owned(store, batch_id)))


@blueprint.get("/v1/batches")
@documented(
    Read(
        "The caller's batches, newest first, a page at a time",
        BatchList,
        "A page of batches.",
        ("400", "401"),
        query_parameters={
            "limit": "Batches per page, 1-100 (20).",
            "after": "A batch id: the page starts after it.",
        },
    )
)
async def list_batches() -> Response:
    limit = request.args.get("limit", "20")
    try:
        size = int(limit)
    except ValueError:
        raise bad("limit", f"must be an integer, got {limit!r}") from None
    if not 1 <= size <= 100:
        raise bad("limit", f"must be in 1..100, got {size}")
    store = await current_state().store.batches()
    records, more = await store.page(caller_key_id(), request.args.get("after"), size)
    data = [await _current(store, record) for record in records]
    return json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


@blueprint.post("/v1/batches/<batch_id>/cancel")
@documented(
    Read(
        "Cancels a batch: `cancelling` until its running lines end, then `cancelled`",
        BatchObject,
        "The batch, `cancelling` (one already cancelling or cancelled as it is).",
        _STATUSES,
        path_parameters=_ID,
    )
)
async def cancel_batch(batch_id: str) -> Response:
    store = await current_state().store.batches()
    record = await _owned(store, batch_id)
    if record.status in CANCELLABLE:
        cancelling = moved(record.batch, "cancelling")
        if await store.transition(batch_id, CANCELLABLE, cancelling):
            return json_response(await _current(store, await _owned(store, batch_id)))
        record = await _owned(store, batch_id)  # it moved on meanwhile
    if record.status in ("cancelling", "cancelled"):
        return json_response(await _current(store, record))
    raise InvalidRequestError(
        f"Cannot cancel a batch with status '{record.status}'.",
        param="batch_id",
        code="batch_not_cancellable",
    )


async def _owned(store: BatchStore, batch_id: str) -> BatchRecord:
    record = await store.get(batch_id, caller_key_id())
    if record is None:
        raise NotFoundError(f"No batch found with id '{batch_id}'.", param="batch_id")
    return record


async def _current(store: BatchStore, record: BatchRecord) -> dict[str, object]:
    """The Batch object, with the live ``request_counts`` of a batch being worked on."""
    if record.status in ("in_progress", "finalizing", "cancelling"):
        return {**record.batch, "request_counts": request_counts(await store.counts(record.id))}
    return record.batch
