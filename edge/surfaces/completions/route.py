"""``POST /v1/completions``: validate, one worker call per prompt, answer on
:func:`edge.surfaces.answer.generate` (``k`` prompts by ``n`` choices in one answer)."""

from __future__ import annotations

from quart import Blueprint
from quart.wrappers import Response

from edge.http import current_request_id, current_settings, read_json_body
from edge.surfaces.answer import generate_openai
from edge.surfaces.completions.request import parse_completion_request
from edge.surfaces.completions.translate import CompletionsTranslator, to_generate_requests
from edge.surfaces.shared.structured import naming_form

blueprint = Blueprint("completions", __name__)


@blueprint.post("/v1/completions")
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
