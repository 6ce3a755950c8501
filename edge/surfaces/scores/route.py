"""``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` and ``/v1/score``: validate, one ``Score`` call on a
worker serving the model with ``--task score`` or ``embed``, answer."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_request_id, read_json_body
from edge.openapi import Unary, documented
from edge.surfaces.scores.request import (
    RerankRequest,
    ScoreRequest,
    parse_rerank_request,
    parse_score_request,
    to_score_request,
)
from edge.surfaces.scores.response import RerankResponse, ScoreList, rerank_response, score_list
from edge.surfaces.shared import pooled

blueprint = Blueprint("scores", __name__)
# Path -> endpoint name (vLLM serves all three; Jina's client posts to /v1, Cohere's to /v2).
RERANK_PATHS = {"/rerank": "rerank", "/v1/rerank": "rerank_v1", "/v2/rerank": "rerank_v2"}


@documented(
    Unary(
        "Rerank documents by relevance to a query (Jina's and Cohere's shape, as vLLM serves it); "
        "needs a worker started with --task score or embed",
        RerankRequest,
        RerankResponse,
        pooled=True,
    )
)
async def rerank() -> Response:
    request = parse_rerank_request(await read_json_body())
    pairs = [(request.query, text) for text in request.texts]
    reply, worker_id = await pooled.score(to_score_request(request.model, pairs, current_request_id()))
    return pooled.answer(rerank_response(reply, request), worker_id)


for _path, _endpoint in RERANK_PATHS.items():
    blueprint.add_url_rule(_path, _endpoint, rerank, methods=["POST"])


@blueprint.post("/v1/score")
@documented(
    Unary(
        "Scores of text pairs (vLLM's); needs a worker started with --task score or embed",
        ScoreRequest,
        ScoreList,
        pooled=True,
    )
)
async def score() -> Response:
    request, pairs = parse_score_request(await read_json_body())
    reply, worker_id = await pooled.score(to_score_request(request.model, pairs, current_request_id()))
    return pooled.answer(score_list(reply), worker_id)
