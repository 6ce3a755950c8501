"""``GET /health`` (liveness) and ``GET /ready`` (the pool holds at least one SERVING worker)."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.errors import ServiceUnavailableError
from edge.routes.common import json_response
from edge.state import current_state

blueprint = Blueprint("health", __name__)


@blueprint.get("/health")
async def health() -> Response:
    """Always 200 while the process serves: liveness must not depend on workers."""
    return json_response({"status": "ok"})


@blueprint.get("/ready")
async def ready() -> Response:
    """200 when the pool holds a SERVING worker (its background health checks), else 503 with
    an OpenAI error; both list every worker's state. Asks no worker itself.

    While the edge drains (SIGTERM), 503 ``server_shutting_down`` at once, whatever the workers say.
    """
    state = current_state()
    if state.drain.draining:
        draining = ServiceUnavailableError("The edge is shutting down.", code="server_shutting_down")
        return json_response({**draining.payload(), "status": "draining"}, status=503)
    checks = await state.pool.health()
    workers = [{"address": c.address, "status": c.status, "outstanding": c.outstanding} for c in checks]
    if any(c.serving for c in checks):
        return json_response({"status": "ready", "workers": workers})
    error = ServiceUnavailableError("No model worker is serving.", code="no_worker_serving")
    return json_response({**error.payload(), "status": "not_ready", "workers": workers}, status=503)
