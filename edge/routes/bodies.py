"""The bodies of the non-surface routes (models, health, readiness), for the OpenAPI document."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from edge.requests.errors import ErrorBody
from edge.requests.models import ResponseModel


class ChatFormats(ResponseModel):
    """The model family's formats chosen by the worker at load."""

    family: str
    tool_call_parser: str
    reasoning_parser: str | None
    thinking_switch: str


class ModelObject(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    task: Literal["generate", "embed", "score"] | None = Field(
        default=None, description="What the model is served for (the worker's --task)."
    )
    chat_formats: ChatFormats | None = None
    accepts_images: bool | None = Field(
        default=None, description="True for a vision-language model (it takes image parts); absent otherwise."
    )
    parent: str | None = Field(default=None, description="A LoRA adapter's base model; absent for a model.")
    root: str | None = Field(default=None, description="A LoRA adapter's folder on the workers' hosts.")


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelObject]


class Health(ResponseModel):
    status: Literal["ok"]


class WorkerState(ResponseModel):
    address: str
    status: Literal["SERVING", "NOT_SERVING", "LOADING", "UNKNOWN", "UNREACHABLE", "SERVICE_UNKNOWN"]
    outstanding: int
    # While LOADING: how far the worker's model load has come (0 to 1), when it said.
    load_fraction: float | None = None


class Readiness(ResponseModel):
    """``/ready``: 200 with ``status: ready``, or 503 with ``status: not_ready`` and an ``error``."""

    status: Literal["ready", "not_ready"]
    workers: list[WorkerState]
    error: ErrorBody | None = None
