"""Chat prompts for a tekken tokenizer, encoded by mistral-common itself (the reference for Mistral's
models): the chat as a ``ChatCompletionRequest``, tool-call ids as nine alphanumerics, earlier reasoning
as a think chunk where the tokenizer has ``[THINK]``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from worker.errors import InvalidRequest


class Message(Protocol):
    """What is read of a chat message (worker.prompts.prompt.ChatMessage)."""

    @property
    def role(self) -> str: ...
    @property
    def content(self) -> str | None: ...
    @property
    def name(self) -> str: ...
    @property
    def tool_call_id(self) -> str: ...
    @property
    def tool_calls(self) -> tuple[dict[str, Any], ...]: ...  # {"id", "name", "arguments"}
    @property
    def reasoning_content(self) -> str | None: ...


def encode_mistral_chat(
    mistral: Any, messages: Sequence[Message], tools: Sequence[dict[str, Any]], call_id: Callable[[str], str]
) -> list[int]:
    """Token ids of a chat (``tools``: {"name", "description", "parameters"}), by ``mistral`` (a
    mistral-common ``MistralTokenizer``); ``call_id`` maps a client's tool-call id to Mistral's."""
    from mistral_common.exceptions import MistralCommonException
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, Tool

    thinks = mistral_thinks(mistral)
    try:
        request = ChatCompletionRequest(
            messages=[_message(message, call_id, thinks) for message in messages],
            tools=[Tool(function=Function(**tool)) for tool in tools] or None,
        )
        return list(mistral.encode_chat_completion(request).tokens)
    except (MistralCommonException, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise InvalidRequest(f"mistral-common rejected the messages: {exc}", param="messages") from exc


def mistral_thinks(mistral: Any) -> bool:
    """Whether the tokenizer's requests carry thinking (``[THINK]``, tokenizer v13 and later)."""
    from mistral_common.tokens.tokenizers.base import TokenizerVersion

    inner = mistral.instruct_tokenizer.tokenizer
    return bool(inner.version >= TokenizerVersion.v13 and "[THINK]" in inner._special_tokens_reverse_vocab)


def _message(message: Message, call_id: Callable[[str], str], thinks: bool) -> Any:
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        TextChunk,
        ThinkChunk,
        ToolMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.tool_calls import FunctionCall, ToolCall

    role, content = message.role, message.content
    if role in ("system", "developer"):
        return SystemMessage(content=content or "")
    if role == "user":
        return UserMessage(content=content or "")
    if role == "tool":
        return ToolMessage(
            content=content or "", tool_call_id=call_id(message.tool_call_id), name=message.name or None
        )
    calls = [
        ToolCall(
            id=call_id(call["id"]),
            function=FunctionCall(name=call["name"], arguments=_arguments_text(call["arguments"])),
        )
        for call in message.tool_calls
    ]
    body: Any = content or None
    reasoning = message.reasoning_content
    if reasoning and thinks:
        body = [ThinkChunk(thinking=reasoning), *([TextChunk(text=content)] if content else [])]
    return AssistantMessage(content=body, tool_calls=calls or None)


def _arguments_text(arguments: str) -> str:
    """A call's arguments as JSON text (kept as given when it is not JSON)."""
    try:
        return json.dumps(json.loads(arguments or "{}"), ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments
