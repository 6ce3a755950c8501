"""The ``/tokenize`` and ``/detokenize`` bodies (vLLM's shapes), validated; a chat is checked by
the chat request's own rules and becomes the worker's ``ChatInput`` exactly as for a generation."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictBool

from edge.requests.limits import RequestLimits, active_limits
from edge.requests.models import RequestModel
from edge.requests.validation import bad, validate_body
from edge.surfaces.shared.chat_request import ChatCompletionRequest, parse_chat_request
from edge.surfaces.shared.worker_request import to_generate_request
from sluice.limits import INT32_MAX
from sluice.v1 import worker_pb2


class TokenizeRequest(RequestModel):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (with ``tools``), not both."""

    model: str = ""
    prompt: str | None = Field(default=None, description="Raw text, tokenized without a template.")
    messages: list[Any] | None = Field(
        default=None, description="A chat, rendered with the model's template as a generation renders it."
    )
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = Field(
        default=True, description="Chat only: end with the opening of the assistant's turn."
    )
    add_special_tokens: StrictBool | None = Field(
        default=None,
        description="Add the tokenizer's special tokens (BOS...); default true for a prompt, false for a "
        "chat (its template writes them).",
    )
    return_token_strs: StrictBool = Field(default=False, description="Also return each token's text.")


class DetokenizeRequest(RequestModel):
    """``POST /detokenize``."""

    model: str = ""
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)]
    skip_special_tokens: StrictBool = False


def parse_tokenize_request(
    body: Any, request_id: str, limits: RequestLimits | None = None
) -> worker_pb2.TokenizeRequest:
    """The worker's ``TokenizeRequest`` for a ``/tokenize`` body whose images (if any) need no
    fetch; raises a 400 naming the field."""
    request, chat = parse_tokenize_body(body, limits)
    return tokenize_proto(request, chat, request_id)


def parse_tokenize_body(
    body: Any, limits: RequestLimits | None = None
) -> tuple[TokenizeRequest, ChatCompletionRequest | None]:
    """A ``/tokenize`` body validated, with its chat (``None`` for a ``prompt``); raises a 400 naming
    the field. The route fetches the chat's image URLs before :func:`tokenize_proto`."""
    request = validate_body(TokenizeRequest, body)
    if (request.prompt is None) == (request.messages is None):
        raise bad("prompt", "give either 'prompt' (text) or 'messages' (a chat), not both")
    if request.prompt is not None:
        limit = (limits or active_limits()).max_prompt_chars
        if len(request.prompt) > limit:
            raise bad(
                "prompt", f"the prompt holds {len(request.prompt)} characters; at most {limit} are accepted"
            )
        return request, None
    chat_body: dict[str, Any] = {"model": request.model, "messages": request.messages}
    for name in ("tools", "tool_choice", "chat_template_kwargs"):
        if getattr(request, name) is not None:
            chat_body[name] = getattr(request, name)
    return request, parse_chat_request(chat_body, limits)


def tokenize_proto(
    request: TokenizeRequest, chat: ChatCompletionRequest | None, request_id: str
) -> worker_pb2.TokenizeRequest:
    """The worker's ``TokenizeRequest`` for a body parsed by :func:`parse_tokenize_body`."""
    proto = worker_pb2.TokenizeRequest(model=request.model, return_token_strs=request.return_token_strs)
    if chat is None:
        proto.prompt.text = request.prompt or ""
    else:
        proto.chat.CopyFrom(to_generate_request(chat, request_id).chat)
        proto.add_generation_prompt = request.add_generation_prompt
    if request.add_special_tokens is not None:
        proto.add_special_tokens = request.add_special_tokens
    return proto


def parse_detokenize_request(body: Any) -> worker_pb2.DetokenizeRequest:
    """The worker's ``DetokenizeRequest`` for a ``/detokenize`` body; raises a 400 naming the field."""
    request = validate_body(DetokenizeRequest, body)
    return worker_pb2.DetokenizeRequest(
        model=request.model, ids=request.tokens, skip_special_tokens=request.skip_special_tokens
    )
