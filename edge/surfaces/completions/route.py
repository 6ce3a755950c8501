"""``POST /v1/completions``: validate, one worker call per prompt, answer on
:func:`edge.surfaces.answer.generate` (``k`` prompts by ``n`` choices in one answer).
``POST /infill``: llama.cpp's fill-in-the-middle body on the same path (:mod:`.infill`)."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.errors import InvalidRequestError
from edge.http import current_request_id, current_settings, read_json_body
from edge.openapi import Generation, LlamaCppGeneration, documented
from edge.surfaces.answer import generate, generate_openai
from edge.surfaces.completions.infill import (
    LLAMA_CPP,
    InfillRequest,
    InfillResult,
    InfillTranslator,
    infill_error,
    parse_infill_request,
)
from edge.surfaces.completions.request import CompletionRequest, parse_completion_request
from edge.surfaces.completions.response import TextCompletion, TextCompletionChunk
from edge.surfaces.completions.translate import CompletionsTranslator, to_generate_requests
from edge.surfaces.shared.structured import naming_form

blueprint = Blueprint("completions", __name__)
# llama.cpp's surface, on the completions path: its own blueprint, listed with the tokenizer routes.
infill_blueprint = Blueprint("infill", __name__)


@blueprint.post("/v1/completions")
@documented(Generation("Text completion (legacy)", CompletionRequest, TextCompletion, TextCompletionChunk))
async def completions() -> Response:
    completion = parse_completion_request(await read_json_body(), current_settings().limits)
    with naming_form(completion.structured_form()):
        return await generate_openai(
            to_generate_requests(completion, current_request_id()),
            completion,
            CompletionsTranslator,
            "cmpl",
            n=completion.choices_per_prompt,
            echo=completion.echo,
            logprobs=completion.logprobs is not None,
        )


@infill_blueprint.post("/infill")
@documented(LlamaCppGeneration("Fill-in-the-middle, llama.cpp's shape", InfillRequest, InfillResult))
async def infill() -> Response:
    completion = parse_infill_request(await read_json_body(), current_settings().limits)
    try:
        return await generate(
            to_generate_requests(completion, current_request_id()),
            InfillTranslator,
            model=completion.model,
            stream=completion.stream,
            framing=LLAMA_CPP,
        )
    except InvalidRequestError as error:  # the worker's refusal (a model without FIM tokens)
        raise infill_error(error) from None
