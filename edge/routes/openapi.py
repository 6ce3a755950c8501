"""``GET /openapi.json``: the OpenAPI 3.1 document (:mod:`edge.openapi`); open without a key."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.http import json_response
from edge.openapi import openapi_document

blueprint = Blueprint("openapi", __name__)


@blueprint.get("/openapi.json")
async def openapi_json() -> Response:
    return json_response(openapi_document())
