"""The native API: ``POST /api/v1/chat`` (named events, or one JSON body) and ``GET /api/v1/models``.

The chat request is rewritten as a chat completions request
(:mod:`edge.native_types`) and answered from the worker's events by
:mod:`edge.translate_native`; ``stream: false`` (the default) answers the body
that the stream's ``chat.end`` carries. Errors are in the native shape
(:mod:`edge.surface_errors`). The call order, time limits and cancellation
rules are those of :mod:`edge.routes.generation`.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint
from quart.wrappers import Response

from edge import translate
from edge.native_types import parse_native_request
from edge.routes.common import current_pool, current_request_id, json_response, read_json_body, worker_header
from edge.routes.generation import open_calls, response_headers
from edge.routes.surfaces import answer_json, answer_stream
from edge.translate_native import NativeTranslator
from edge.translate_responses import new_id
from sluice.v1 import worker_pb2

blueprint = Blueprint("native", __name__)


@blueprint.post("/api/v1/chat")
async def chat() -> Response:
    request_id = current_request_id()
    parsed = parse_native_request(await read_json_body())
    worker_request = translate.to_generate_request(parsed.chat, request_id)
    parsed.apply_sampling(worker_request)
    # A streamed answer shows a model load as model_load.* events; a JSON one waits silently.
    group = await open_calls(
        [worker_request], translate.call_metadata(parsed.chat, request_id), load_events=parsed.stream
    )
    try:
        translator = NativeTranslator(
            response_id=new_id("resp"),
            model_instance_id=group.started(0).model or parsed.chat.model,
            tools={tool.name: tool.parameters for tool in parsed.tools},
        )
        headers = response_headers(group)
        if not parsed.stream:
            return await answer_json(group, translator, headers)
        return answer_stream(group, translator, headers, "native")
    except BaseException:
        group.cancel()
        raise


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
