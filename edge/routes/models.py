"""``GET /v1/models`` and ``GET /v1/models/<id>`` (ids may contain "/").

Both answer ``X-Sluice-Worker-ID`` with the ids of the workers that answered
the listing (comma-separated when there are several).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint
from quart.wrappers import Response

from edge.errors import NotFoundError
from edge.http import current_pool, json_response, worker_header
from edge.openapi import Read, documented
from edge.routes.bodies import ModelList, ModelObject
from sluice.v1 import worker_pb2

blueprint = Blueprint("models", __name__)


def model_object(model: worker_pb2.ModelInfo) -> dict[str, Any]:
    """The OpenAI model object for one worker model, with its task, the chat formats the worker
    chose and, for a vision-language model, ``accepts_images``."""
    shown: dict[str, Any] = {
        "id": model.id,
        "object": "model",
        "created": model.created,
        "owned_by": model.owned_by or "sluice",
    }
    if model.parent:  # a LoRA adapter: vLLM's card names its base model and its folder
        shown["parent"] = model.parent
        shown["root"] = model.source
    if model.task:
        shown["task"] = model.task
    if model.accepts_images:
        shown["accepts_images"] = True
    if model.HasField("chat_formats"):
        formats = model.chat_formats
        shown["chat_formats"] = {
            "family": formats.family,
            "tool_call_parser": formats.tool_call_parser,
            "reasoning_parser": formats.reasoning_parser or None,
            "thinking_switch": formats.thinking_switch,
        }
    return shown


@blueprint.get("/v1/models")
@documented(Read("The models the workers serve", ModelList, "The model list."))
async def list_models() -> Response:
    listing = await current_pool().list_models()
    return json_response(
        {"object": "list", "data": [model_object(m) for m in listing.models]},
        headers=worker_header(listing.worker_ids),
    )


@blueprint.get("/v1/models/<path:model_id>")
@documented(
    Read(
        "One model",
        ModelObject,
        "The model.",
        ("401", "404", "503"),
        path_parameters={"model_id": "The model id; it may contain '/'."},
    )
)
async def retrieve_model(model_id: str) -> Response:
    listing = await current_pool().list_models()
    for model in listing.models:
        if model.id == model_id:
            return json_response(model_object(model), headers=worker_header(listing.worker_ids))
    error = NotFoundError(
        f"The model '{model_id}' does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )
    error.worker_id = ",".join(listing.worker_ids) or None
    raise error
