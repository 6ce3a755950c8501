"""``GET /`` and ``GET /playground``: the browser playground (docs/playground.md).

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from quart import Blueprint, current_app
from quart.wrappers import Response

blueprint = Blueprint("playground", __name__)

PAGE = "playground.html"
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@blueprint.get("/")
@blueprint.get("/playground")
async def playground() -> Response:
    """The playground page, revalidated on every load (``no-cache``) so an upgrade shows at once."""
    response = await current_app.send_static_file(PAGE)
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["Cache-Control"] = "no-cache"
    return response
