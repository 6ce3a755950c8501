"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's bodies): a LoRA adapter
served or dropped on every worker, with ``--allow-runtime-lora`` only (404 otherwise)."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.errors import NotFoundError
from edge.http import current_pool, current_settings, json_response, read_json_body, worker_header
from edge.openapi import Unary, documented
from edge.requests.models import RequestModel, ResponseModel
from edge.requests.validation import validate_body
from sluice.v1 import worker_pb2

blueprint = Blueprint("lora", __name__)


class LoadLoraAdapterRequest(RequestModel):
    """``POST /v1/load_lora_adapter``: a PEFT folder on the workers' hosts, served as ``lora_name``."""

    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(RequestModel):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str
    lora_int_id: int | None = None  # vLLM's, accepted and unused


class LoraAdapterResult(ResponseModel):
    lora_name: str
    message: str


def _allowed() -> None:
    if not current_settings().allow_runtime_lora:
        raise NotFoundError(
            "Runtime LoRA adapter loading is off; start the edge with --allow-runtime-lora.",
            code="not_found",
        )


@blueprint.post("/v1/load_lora_adapter")
@documented(
    Unary(
        "Serve a LoRA adapter on every worker (--allow-runtime-lora)",
        LoadLoraAdapterRequest,
        LoraAdapterResult,
    )
)
async def load_lora_adapter() -> Response:
    _allowed()
    body = validate_body(LoadLoraAdapterRequest, await read_json_body())
    request = worker_pb2.LoadLoraAdapterRequest(
        lora_name=body.lora_name, lora_path=body.lora_path, base_model_name=body.base_model_name or ""
    )
    worker_ids = await current_pool().lora_adapter(request)
    message = f"Success: LoRA adapter '{body.lora_name}' added successfully."
    return json_response({"lora_name": body.lora_name, "message": message}, headers=worker_header(worker_ids))


@blueprint.post("/v1/unload_lora_adapter")
@documented(
    Unary(
        "Stop serving a LoRA adapter on every worker (--allow-runtime-lora)",
        UnloadLoraAdapterRequest,
        LoraAdapterResult,
    )
)
async def unload_lora_adapter() -> Response:
    _allowed()
    body = validate_body(UnloadLoraAdapterRequest, await read_json_body())
    worker_ids = await current_pool().lora_adapter(
        worker_pb2.UnloadLoraAdapterRequest(lora_name=body.lora_name)
    )
    message = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
    return json_response({"lora_name": body.lora_name, "message": message}, headers=worker_header(worker_ids))
