"""Turns chat messages or a raw prompt into token ids, with the model's own chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from worker.errors import InvalidRequest
from worker.model.mistral_tokenizer import mistral_common_of
from worker.prompts.family import FamilyProfile, nine_char_id
from worker.prompts.fim import FimTokens, find_fim_tokens
from worker.prompts.images import ImageData, ImageProcessing
from worker.prompts.mistral_prompt import encode_mistral_chat
from worker.prompts.vocabulary import TokenIndex
from worker.types import PromptImage

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None = None
    name: str = ""
    tool_call_id: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()
    reasoning_content: str | None = None
    # Content that mixes text and images, in order (``content`` is then None): a text part is a str.
    parts: tuple[str | ImageData, ...] = ()

    @property
    def images(self) -> tuple[ImageData, ...]:
        return tuple(part for part in self.parts if isinstance(part, ImageData))


@dataclass(frozen=True)
class ChatPrompt:
    messages: tuple[ChatMessage, ...]
    tools: tuple[dict[str, Any], ...] = ()  # {"name", "description", "parameters"}
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    forced_tool: str = ""  # a function the answer must call; "*" = any of the tools


TOOL_PROMPT = """You can call functions to help answer. These are the functions, one JSON object per line:
{tools}

To call a function, answer with a block like this for each call, and nothing else:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments, as JSON>}}}}
</tool_call>
A function's result comes back in a <tool_response> block. If no function is needed, answer normally."""
TOOL_LISTING = "You can call these functions, one JSON object per line:\n{tools}"
FORCED_ONE = "\nCall the function `{name}` now."
FORCED_ANY = "\nCall one of the functions now."


@dataclass(frozen=True)
class RawPrompt:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    suffix: str = ""  # fill-in-the-middle: the text after the gap (``text``/``token_ids`` before it)


# Why a model that is no vision-language model refuses a request's image parts.
NO_IMAGES = "this model takes no images (it is not a vision-language model)"


class PromptRenderer:
    """Renders prompts for one tokenizer. ``render`` returns (token ids, prompt text); the same
    call serves Generate and Tokenize, so a chat's count is the prompt Generate computes."""

    def __init__(
        self,
        tokenizer: Any,
        profile: FamilyProfile | None = None,
        images: ImageProcessing | None = None,
    ):
        """``images``: a vision-language model's processing (None: the model takes no images)."""
        self._tokenizer = tokenizer
        self._images = images
        self.profile = profile or FamilyProfile("unknown")
        template = self.profile.template or getattr(tokenizer, "chat_template", None)
        self._mistral = mistral_common_of(tokenizer)  # a tekken tokenizer: mistral-common renders
        # mistral-common's tokenizer class renders with mistral-common itself and has no template text.
        self.has_chat_template = (
            bool(template) or self._mistral is not None or type(tokenizer).__name__ == "MistralCommonBackend"
        )
        # A template that renders the probe's tools itself gets them; others get TOOL_PROMPT.
        self.template_knows_tools = self.profile.template_tools
        self.thinks = self.profile.reasoning_parser is not None
        self.vocab_size = len(tokenizer)
        self.fim: FimTokens | None = find_fim_tokens(TokenIndex(tokenizer))

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids without special tokens (a bad word's forms)."""
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(
        self,
        prompt: ChatPrompt | RawPrompt,
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[tuple[int, ...], str]:
        """``add_special_tokens``: the tokenizer's BOS and the like; None = Generate's rule (yes
        for raw text, no for a chat, whose template writes them). ``add_generation_prompt``: a
        chat ends with the opening of the assistant's turn."""
        ids, text, _ = self.render_with_images(
            prompt, add_special_tokens=add_special_tokens, add_generation_prompt=add_generation_prompt
        )
        return ids, text

    @property
    def accepts_images(self) -> bool:
        return self._images is not None

    def render_with_images(
        self,
        prompt: ChatPrompt | RawPrompt,
        *,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[tuple[int, ...], str, tuple[PromptImage, ...]]:
        """:meth:`render`, and a chat's images (their placeholders expanded in the ids by the model's
        processor); InvalidRequest naming ``messages[i].parts`` when the model takes no images."""
        if isinstance(prompt, RawPrompt):
            ids, text = self._render_raw(prompt, add_special_tokens is not False)
            return ids, text, ()
        if any(m.images for m in prompt.messages):
            return self._render_images(prompt, add_generation_prompt)
        if not self.has_chat_template:
            raise InvalidRequest(
                "this model has no chat template; send a raw prompt instead", param="messages"
            )
        if self._mistral is not None:  # mistral-common encodes the chat itself (ids, not text)
            encoded = encode_mistral_chat(self._mistral, prompt.messages, prompt.tools, nine_char_id)
            return tuple(encoded), self._tokenizer.decode(encoded, skip_special_tokens=False), ()
        text = self.chat_text(prompt, add_generation_prompt=add_generation_prompt)
        ids = self._tokenizer(text, add_special_tokens=bool(add_special_tokens))["input_ids"]
        return tuple(ids), text, ()

    def _render_images(
        self, prompt: ChatPrompt, add_generation_prompt: bool
    ) -> tuple[tuple[int, ...], str, tuple[PromptImage, ...]]:
        images: list[tuple[ImageData, str]] = []
        for i, message in enumerate(prompt.messages):
            if not message.images:
                continue
            if self._images is None:
                raise InvalidRequest(f"messages[{i}].parts: {NO_IMAGES}", param=f"messages[{i}].parts")
            if message.role != "user":
                raise InvalidRequest(
                    f"messages[{i}].parts: only user messages may carry images", param=f"messages[{i}].parts"
                )
            images += [
                (part, f"messages[{i}].parts[{j}]")
                for j, part in enumerate(message.parts)
                if isinstance(part, ImageData)
            ]
        if prompt.tools:
            raise InvalidRequest("images cannot be combined with tools yet", param="tools")
        assert self._images is not None
        text = self.chat_text(prompt, add_generation_prompt=add_generation_prompt)
        ids, prompt_images = self._images.process(text, images)
        return ids, text, prompt_images

    def decode(self, token_ids: tuple[int, ...], *, skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (Detokenize's, a truncated prompt's); special tokens kept unless
        ``skip_special_tokens``. An id outside the vocabulary is refused naming ``tokens``."""
        self.check_ids(token_ids, "tokens")
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_strings(self, token_ids: tuple[int, ...]) -> list[str]:
        """Each token as the vocabulary spells it."""
        return [str(token) for token in self._tokenizer.convert_ids_to_tokens(list(token_ids))]

    def check_ids(self, token_ids: tuple[int, ...], param: str) -> None:
        for position, token in enumerate(token_ids):
            if not 0 <= token < self.vocab_size:
                raise InvalidRequest(
                    f"{param}: token {token} at position {position} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})",
                    param=param,
                )

    def _render_raw(self, prompt: RawPrompt, add_special_tokens: bool) -> tuple[tuple[int, ...], str]:
        if prompt.token_ids is not None:
            if not prompt.token_ids:
                raise InvalidRequest("prompt.token_ids is empty", param="prompt")
            self.check_ids(prompt.token_ids, "prompt")
            if prompt.suffix:
                return self._fill_in_the_middle(list(prompt.token_ids), prompt.suffix, add_special_tokens)
            return prompt.token_ids, self._tokenizer.decode(list(prompt.token_ids))
        text = prompt.text or ""
        if prompt.suffix:
            prefix = self._tokenizer(text, add_special_tokens=False)["input_ids"]
            return self._fill_in_the_middle(prefix, prompt.suffix, add_special_tokens)
        if not text:
            raise InvalidRequest("prompt is empty", param="prompt")
        return tuple(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), text

    def _fill_in_the_middle(
        self, prefix_ids: list[int], suffix: str, add_special_tokens: bool
    ) -> tuple[tuple[int, ...], str]:
        """The FIM prompt: the model's markers around the prefix's and suffix's tokens (an empty
        prefix is allowed: the gap is at the start), after the tokenizer's BOS."""
        if self.fim is None:
            raise InvalidRequest(
                "suffix: this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, "
                "<fim_suffix>, <PRE>) in its vocabulary",
                param="suffix",
            )
        suffix_ids = self._tokenizer(suffix, add_special_tokens=False)["input_ids"]
        start = self._tokenizer("", add_special_tokens=True)["input_ids"] if add_special_tokens else []
        ids = (*start, *self.fim.layout(prefix_ids, suffix_ids))
        return ids, self._tokenizer.decode(list(ids))

    def chat_text(self, prompt: ChatPrompt, *, add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the chat template (and the built-in tool prompt)."""
        kwargs: dict[str, Any] = {**self.profile.default_kwargs, **prompt.template_kwargs}
        self._switch_thinking(kwargs)
        if self.profile.template:
            kwargs["chat_template"] = self.profile.template
        if prompt.tools and self.template_knows_tools:
            tools = [{"type": "function", "function": tool} for tool in prompt.tools]
            messages = [self._message_dict(m) for m in prompt.messages]
            if self.profile.tools_in_system:
                if not messages or messages[0]["role"] != "system":
                    messages.insert(0, {"role": "system", "content": ""})
                messages[0]["tools"] = json.dumps(tools, ensure_ascii=False)
            else:
                kwargs["tools"] = tools
        elif prompt.tools and self.profile.template_calls:
            # The template writes calls in its own format but lists no tools (DeepSeek V3's).
            messages = [self._message_dict(m) for m in prompt.messages]
            listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in prompt.tools)
            _add_to_system(messages, TOOL_LISTING.format(tools=listing))
        elif prompt.tools or any(m.tool_calls or m.role == "tool" for m in prompt.messages):
            messages = builtin_tool_messages(prompt)
        else:
            messages = [self._message_dict(m) for m in prompt.messages]
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except (TemplateError, TypeError, ValueError) as exc:
            raise InvalidRequest(
                f"the model's chat template rejected the messages: {exc}", param="messages"
            ) from exc
        return str(text)

    def _switch_thinking(self, kwargs: dict[str, Any]) -> None:
        """A request's ``enable_thinking`` as the template's own switch (``thinking``, or gpt-oss's
        ``reasoning_effort``, which cannot turn thinking off: off is "low")."""
        switch = self.profile.thinking_switch
        if "enable_thinking" not in kwargs or switch == "enable_thinking" or switch in kwargs:
            return
        on = bool(kwargs.pop("enable_thinking"))
        kwargs[switch] = on if switch != "reasoning_effort" else ("medium" if on else "low")

    def _call_id(self, call_id: str) -> str:
        return nine_char_id(call_id) if self.profile.nine_char_ids else call_id

    def _message_dict(self, message: ChatMessage) -> dict[str, Any]:
        # Most templates know no "developer" role; it means "system" (as OpenAI documents).
        role = "system" if message.role == "developer" else message.role
        result: dict[str, Any] = {"role": role, "content": _content(message)}
        if message.name:
            result["name"] = message.name
        if message.tool_call_id:
            result["tool_call_id"] = self._call_id(message.tool_call_id)
        if message.tool_calls and not message.content and self.profile.null_call_content:
            result["content"] = None
        if message.tool_calls:
            result["tool_calls"] = [
                {
                    "id": self._call_id(call["id"]),
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": call["arguments"] or "{}"
                        if self.profile.arguments_as_text
                        else _arguments(call["arguments"]),
                    },
                }
                for call in message.tool_calls
            ]
        if message.reasoning_content:
            result[self.profile.reasoning_field] = message.reasoning_content
        return result


def _content(message: ChatMessage) -> Any:
    """The message's content for the template: its text, or its parts as typed items (images as
    ``{"type": "image"}``, which a vision-language template renders as the image marker)."""
    if not message.images:
        return message.content or "".join(part for part in message.parts if isinstance(part, str))
    return [
        {"type": "text", "text": part} if isinstance(part, str) else {"type": "image"}
        for part in message.parts
    ]


def _arguments(text: str) -> Any:
    """Templates expect arguments as a mapping; keep the text when it is not JSON."""
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text


def _call_text(call: dict[str, Any]) -> str:
    body = json.dumps({"name": call["name"], "arguments": _arguments(call["arguments"])}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def builtin_tool_messages(prompt: ChatPrompt) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: the tools go into the system message (TOOL_PROMPT),
    earlier calls into the assistant's text, and tool results into user turns as <tool_response> blocks."""
    messages: list[dict[str, Any]] = []
    for message in prompt.messages:
        role = "system" if message.role == "developer" else message.role
        content = _content(message)
        if message.tool_calls:
            calls = "\n".join(_call_text(call) for call in message.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        messages.append({"role": role, "content": content})
    if prompt.tools:
        listing = "\n".join(
            json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in prompt.tools
        )
        instructions = TOOL_PROMPT.format(tools=listing)
        if prompt.forced_tool == "*":
            instructions += FORCED_ANY
        elif prompt.forced_tool:
            instructions += FORCED_ONE.format(name=prompt.forced_tool)
        _add_to_system(messages, instructions)
    return messages


def _add_to_system(messages: list[dict[str, Any]], text: str) -> None:
    """``text`` at the end of the system message (a new one first when there is none)."""
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
    else:
        messages.insert(0, {"role": "system", "content": text})
