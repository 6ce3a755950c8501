"""``GET /`` and ``GET /playground``: the browser playground (docs/playground.md).

The page is static: ``edge/static/playground.html`` plus its script and style
sheet, which the app's static route serves under ``/static/``. The files ship
inside the package (``[tool.setuptools.package-data]``), so an installed edge
serves them with no build step and no network. Neither path is under ``/v1/``,
so loading the page never needs an API key (:mod:`edge.auth`); the page asks
for one when ``/v1/models`` answers 401 and keeps it in memory only.

The Content-Security-Policy lets the page load and call nothing but its own
origin: no external script, style, font or image can sneak in.
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
