"""``GET /metrics``: the edge's Prometheus metrics (see :mod:`edge.metrics`, docs/observability.md).

Open like ``/health``: it is outside ``/v1/``, so API keys do not guard it.
It names worker addresses, so keep the edge's port off the public internet
or block ``/metrics`` at the proxy in front of it.
"""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.openapi import Page, documented
from edge.state import current_state
from sluice.prometheus import CONTENT_TYPE

blueprint = Blueprint("metrics", __name__)


@blueprint.get("/metrics")
@documented(
    Page(
        "Prometheus metrics of the edge (no API key needed)",
        "text/plain",
        "The Prometheus text exposition format 0.0.4.",
    )
)
async def metrics() -> Response:
    """The exposition text; worker health is asked of the pool at each scrape."""
    state = current_state()
    text = await state.metrics.render(state.pool, state.limiter)
    return Response(text, status=200, content_type=CONTENT_TYPE)
