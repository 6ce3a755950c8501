"""``POST /v1/embeddings``: validate, one ``Embed`` call on a worker serving the model with
``--task embed``, answer."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_request_id, read_json_body
from edge.openapi import Unary, documented
from edge.surfaces.embeddings.request import EmbeddingRequest, parse_embedding_request, to_embed_request
from edge.surfaces.embeddings.response import EmbeddingList, embedding_list
from edge.surfaces.shared import pooled

blueprint = Blueprint("embeddings", __name__)


@blueprint.post("/v1/embeddings")
@documented(
    Unary(
        "Embeddings (OpenAI); needs a worker started with --task embed",
        EmbeddingRequest,
        EmbeddingList,
        pooled=True,
    )
)
async def embeddings() -> Response:
    request = parse_embedding_request(await read_json_body())
    reply, worker_id = await pooled.embed(to_embed_request(request, current_request_id()))
    return pooled.answer(embedding_list(reply, request.model, request.encoding_format), worker_id)
