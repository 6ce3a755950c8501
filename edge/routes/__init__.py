"""HTTP routes, one blueprint per area. Handlers are thin: parse → delegate → wrap."""

from __future__ import annotations

from quart import Quart

from edge.routes.health import blueprint as health_blueprint
from edge.routes.lora import blueprint as lora_blueprint
from edge.routes.metrics import blueprint as metrics_blueprint
from edge.routes.models import blueprint as models_blueprint
from edge.routes.openapi import blueprint as openapi_blueprint
from edge.routes.playground import blueprint as playground_blueprint
from edge.surfaces.anthropic.route import blueprint as messages_blueprint
from edge.surfaces.batches.route import blueprint as batches_blueprint
from edge.surfaces.chat.route import blueprint as chat_blueprint
from edge.surfaces.completions.route import blueprint as completions_blueprint
from edge.surfaces.completions.route import infill_blueprint
from edge.surfaces.embeddings.route import blueprint as embeddings_blueprint
from edge.surfaces.files.route import blueprint as files_blueprint
from edge.surfaces.native.route import blueprint as native_blueprint
from edge.surfaces.responses.conversations import blueprint as conversations_blueprint
from edge.surfaces.responses.route import blueprint as responses_blueprint
from edge.surfaces.scores.route import blueprint as scores_blueprint
from edge.surfaces.tokenize.route import blueprint as tokenize_blueprint


def register_routes(app: Quart) -> None:
    """Registers every blueprint on ``app``, in the order the OpenAPI document lists their routes."""
    app.register_blueprint(chat_blueprint)
    app.register_blueprint(completions_blueprint)
    app.register_blueprint(embeddings_blueprint)
    app.register_blueprint(scores_blueprint)
    app.register_blueprint(responses_blueprint)
    app.register_blueprint(conversations_blueprint)
    app.register_blueprint(files_blueprint)
    app.register_blueprint(batches_blueprint)
    app.register_blueprint(messages_blueprint)
    app.register_blueprint(tokenize_blueprint)
    app.register_blueprint(infill_blueprint)
    app.register_blueprint(native_blueprint)
    app.register_blueprint(models_blueprint)
    app.register_blueprint(lora_blueprint)
    app.register_blueprint(health_blueprint)
    app.register_blueprint(metrics_blueprint)
    app.register_blueprint(playground_blueprint)
    app.register_blueprint(openapi_blueprint)
