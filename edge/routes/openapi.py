"""``GET /openapi.json``: the OpenAPI 3.1 document of the app's routes (:mod:`edge.openapi`); open
without a key."""

from __future__ import annotations

from quart import Blueprint, current_app
from quart.wrappers import Response

from edge.http import json_response
from edge.openapi import Page, documented, openapi_document

blueprint = Blueprint("openapi", __name__)


@blueprint.get("/openapi.json")
@documented(Page("This document", "application/json", "The OpenAPI 3.1 document.", kind="object"))
async def openapi_json() -> Response:
    return json_response(openapi_document(current_app))
