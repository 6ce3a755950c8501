"""The native API: ``POST /api/v1/chat`` (named events, or one JSON body; a chat request
underneath, :mod:`edge.surfaces.native.request`) and ``GET /api/v1/models``."""

from __future__ import annotations

from typing import Any

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_pool, current_request_id, json_response, read_json_body, worker_header
from edge.surfaces.answer import generate, named_events
from edge.surfaces.native.request import parse_native_request
from edge.surfaces.native.translate import NativeTranslator
from edge.surfaces.shared.ids import new_id
from edge.surfaces.shared.worker_request import call_metadata, to_generate_request
from sluice.v1 import worker_pb2

blueprint = Blueprint("native", __name__)
FRAMING = named_events("native")


@blueprint.post("/api/v1/chat")
async def chat() -> Response:
    request_id = current_request_id()
    parsed = parse_native_request(await read_json_body())
    worker_request = to_generate_request(parsed.chat, request_id)
    parsed.apply_sampling(worker_request)
    tools = {tool.name: tool.parameters for tool in parsed.tools}
    return await generate(
        [worker_request],
        lambda model: NativeTranslator(response_id=new_id("resp"), model_instance_id=model, tools=tools),
        model=parsed.chat.model,
        stream=parsed.stream,
        framing=FRAMING,
        metadata=call_metadata(parsed.chat, request_id),
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
async def list_models() -> Response:
    listing = await current_pool().list_models()
    return json_response(
        {"models": [native_model(m) for m in listing.models]}, headers=worker_header(listing.worker_ids)
    )
