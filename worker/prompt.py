"""Turns chat messages or a raw prompt into token ids, with the model's own chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from worker.errors import InvalidRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None = None
    name: str = ""
    tool_call_id: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()
    reasoning_content: str | None = None


@dataclass(frozen=True)
class ChatPrompt:
    messages: tuple[ChatMessage, ...]
    tools: tuple[dict[str, Any], ...] = ()
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RawPrompt:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None


class PromptRenderer:
    """Renders prompts for one tokenizer. ``render`` returns (token ids, prompt text)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.vocab_size = len(tokenizer)

    def render(self, prompt: ChatPrompt | RawPrompt) -> tuple[tuple[int, ...], str]:
        if isinstance(prompt, RawPrompt):
            return self._render_raw(prompt)
        return self._render_chat(prompt)

    def _render_raw(self, prompt: RawPrompt) -> tuple[tuple[int, ...], str]:
        if prompt.token_ids is not None:
            if not prompt.token_ids:
                raise InvalidRequest("prompt.token_ids is empty", param="prompt")
            for position, token in enumerate(prompt.token_ids):
                if not 0 <= token < self.vocab_size:
                    raise InvalidRequest(
                        f"prompt token {token} at position {position} is outside the vocabulary "
                        f"(0..{self.vocab_size - 1})",
                        param="prompt",
                    )
            return prompt.token_ids, self._tokenizer.decode(list(prompt.token_ids))
        text = prompt.text or ""
        if not text:
            raise InvalidRequest("prompt is empty", param="prompt")
        return tuple(self._tokenizer(text)["input_ids"]), text

    def _render_chat(self, prompt: ChatPrompt) -> tuple[tuple[int, ...], str]:
        if not self.has_chat_template:
            raise InvalidRequest(
                "this model has no chat template; send a raw prompt instead", param="messages"
            )
        messages = [self._message_dict(m) for m in prompt.messages]
        kwargs: dict[str, Any] = dict(prompt.template_kwargs)
        if prompt.tools:
            kwargs["tools"] = list(prompt.tools)
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except (TemplateError, TypeError, ValueError) as exc:
            raise InvalidRequest(
                f"the model's chat template rejected the messages: {exc}", param="messages"
            ) from exc
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        return tuple(ids), text

    @staticmethod
    def _message_dict(message: ChatMessage) -> dict[str, Any]:
        # Most templates know no "developer" role; it means "system" (as OpenAI documents).
        role = "system" if message.role == "developer" else message.role
        result: dict[str, Any] = {"role": role, "content": message.content or ""}
        if message.name:
            result["name"] = message.name
        if message.tool_call_id:
            result["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            result["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": _arguments(call["arguments"])},
                }
                for call in message.tool_calls
            ]
        if message.reasoning_content:
            result["reasoning_content"] = message.reasoning_content
        return result


def _arguments(text: str) -> Any:
    """Templates expect arguments as a mapping; keep the text when it is not JSON."""
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text
