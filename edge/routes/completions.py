"""``POST /v1/completions``: validate, open one worker call per prompt, answer JSON or SSE.

The ``k`` prompts of one request run concurrently; their ``n`` choices each
are merged into one answer with ``k * n`` choices (see
:mod:`edge.translate_completions`). The call order and the cancellation rules
are those of :mod:`edge.routes.generation`.
"""

from __future__ import annotations

import time

from quart import Blueprint
from quart.wrappers import Response

from edge import translate_completions
from edge.completion_types import parse_completion_request
from edge.routes.common import current_request_id, current_settings, json_response, read_json_body
from edge.routes.generation import collect, open_calls, response_headers, sse_response

blueprint = Blueprint("completions", __name__)


@blueprint.post("/v1/completions")
async def completions() -> Response:
    request_id = current_request_id()
    completion = parse_completion_request(await read_json_body(), current_settings().limits)
    group = await open_calls(translate_completions.to_generate_requests(completion, request_id))
    try:
        model = group.started(0).model or completion.model
        completion_id, created = translate_completions.new_text_completion_id(), int(time.time())
        headers = response_headers(group)
        n, echo, logprobs = completion.choices_per_prompt, completion.echo, completion.logprobs is not None
        if not completion.stream:
            accumulator = translate_completions.TextCompletionAccumulator(
                completion_id, created, model, n=n, echo=echo, logprobs=logprobs
            )
            await collect(group, accumulator.add)
            return json_response(accumulator.result(), headers=headers)
        builder = translate_completions.TextChunkBuilder(
            completion_id,
            created,
            model,
            include_usage=completion.include_usage,
            continuous_usage=completion.continuous_usage,
            n=n,
            echo=echo,
            logprobs=logprobs,
        )
        return sse_response(group, builder.on_event, builder.finish, headers)
    except BaseException:
        group.cancel()
        raise
