"""``GET /health`` (liveness) and ``GET /ready`` (the pool holds at least one SERVING worker)."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.errors import ServiceUnavailableError
from edge.http import json_response
from edge.openapi import Probe, documented
from edge.routes.bodies import Health, Readiness
from edge.state import current_state
from edge.workers.worker import WorkerHealth

blueprint = Blueprint("health", __name__)


@blueprint.get("/health")
@documented(Probe("Liveness: 200 while the process serves", {"200": (Health, "Alive.")}))
async def health() -> Response:
    """Always 200 while the process serves: liveness must not depend on workers."""
    return json_response({"status": "ok"})


def worker_state(check: WorkerHealth) -> dict[str, object]:
    """One worker in ``/ready``: address, status, calls in flight, and while it is LOADING how far
    its model load has come (``load_fraction``, 0 to 1) when it said."""
    state: dict[str, object] = {
        "address": check.address,
        "status": check.status,
        "outstanding": check.outstanding,
    }
    if check.load_fraction is not None:
        state["load_fraction"] = check.load_fraction
    return state


@blueprint.get("/ready")
@documented(
    Probe(
        "Readiness: 200 when a worker is SERVING",
        {
            "200": (Readiness, "At least one worker is serving."),
            "503": (Readiness, "No worker is serving (the body has an `error`)."),
        },
    )
)
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
    workers = [worker_state(c) for c in checks]
    if any(c.serving for c in checks):
        return json_response({"status": "ready", "workers": workers})
    error = ServiceUnavailableError("No model worker is serving.", code="no_worker_serving")
    return json_response({**error.payload(), "status": "not_ready", "workers": workers}, status=503)
