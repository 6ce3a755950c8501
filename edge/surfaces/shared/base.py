"""The two pydantic bases of the edge's wire models: one for request bodies, one for answers."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestModel(BaseModel):
    """A request body or part: unknown fields are ignored, NaN and infinities refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ResponseModel(BaseModel):
    """An answer body or part (the OpenAPI document's response schemas): no extra fields."""

    model_config = ConfigDict(extra="forbid")
