"""The native API: ``POST /api/v1/chat`` (named events, or one JSON body; a chat request
underneath, :mod:`edge.surfaces.native.request`) and ``GET /api/v1/models``."""

from __future__ import annotations

from typing import Any

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_pool, json_response, read_json_body, worker_header
from edge.openapi import BEARER_OR_KEY, NamedEventGeneration, Read, documented
from edge.surfaces.answer import generate_rewritten, named_events
from edge.surfaces.native.request import NativeChatRequest, parse_native_request
from edge.surfaces.native.response import (
    NativeChatResult,
    NativeErrorResponse,
    NativeModelList,
    NativeStreamEvent,
)
from edge.surfaces.native.translate import NativeTranslator
from edge.surfaces.shared.ids import new_id
from sluice.v1 import worker_pb2

blueprint = Blueprint("native", __name__)
STREAM = (
    "named events from `chat.start` to `chat.end` (data: `NativeStreamEvent`; `chat.end`'s "
    "`result` is the non-streaming body); a failure is an `error` event, then `chat.end`; "
    "`: heartbeat` comments keep it open."
)
FRAMING = named_events("native")


@blueprint.post("/api/v1/chat")
@documented(
    NamedEventGeneration(
        "Native chat with a stream of named events",
        NativeChatRequest,
        NativeChatResult,
        NativeStreamEvent,
        STREAM,
        NativeErrorResponse,
        BEARER_OR_KEY,
    )
)
async def chat() -> Response:
    parsed = parse_native_request(await read_json_body())
    tools = {tool.name: tool.parameters for tool in parsed.tools}
    return await generate_rewritten(
        parsed,
        lambda model: NativeTranslator(new_id("resp"), model, tools),
        FRAMING,
        # A streamed answer shows a model load as model_load.* events; a JSON one waits silently.
        load_events=parsed.stream,
    )


def native_model(model: worker_pb2.ModelInfo) -> dict[str, Any]:
    """One model of ``GET /api/v1/models``: a loaded LLM with its one instance."""
    return {
        "type": "llm",
        "key": model.id,
        "display_name": model.id,
        "owned_by": model.owned_by or "sluice",
        "max_context_length": model.context_length or None,
        "loaded_instances": [{"id": model.id}],
    }


@blueprint.get("/api/v1/models")
@documented(
    Read(
        "The loaded models, native shape",
        NativeModelList,
        "The model list.",
        error=NativeErrorResponse,
        security=BEARER_OR_KEY,
    )
)
async def list_models() -> Response:
    listing = await current_pool().list_models()
    return json_response(
        {"models": [native_model(m) for m in listing.models]}, headers=worker_header(listing.worker_ids)
    )
