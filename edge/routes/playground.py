"""``GET /`` and ``GET /playground``: the browser playground (docs/playground.md).

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

from quart import Blueprint, current_app
from quart.wrappers import Response

from edge.openapi import Page, documented

blueprint = Blueprint("playground", __name__)

PAGE = "playground.html"
_PAGE = "The playground page (its script and style sheet are under /static/)."
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@blueprint.get("/playground")
@blueprint.get("/")
@documented(
    Page("The browser playground (docs/playground.md); no API key needed", "text/html", _PAGE), path="/"
)
@documented(Page("The browser playground (the same page as /)", "text/html", _PAGE), path="/playground")
async def playground() -> Response:
    """The playground page, revalidated on every load (``no-cache``) so an upgrade shows at once."""
    response = await current_app.send_static_file(PAGE)
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["Cache-Control"] = "no-cache"
    return response
