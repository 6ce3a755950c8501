"""All conversion between the wire (sluice.v1 protobuf) and the worker's own types.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.limits import (
    LOGIT_BIAS,
    MAX_BAD_WORDS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_STREAM_INTERVAL_MS,
    MAX_TOP_LOGPROBS,
    MIN_P,
    PENALTY,
    REPETITION_PENALTY,
    TEMPERATURE,
    TOP_P,
    Range,
)
from sluice.v1 import worker_pb2 as pb
from worker.errors import InvalidRequest, ModelNotFound
from worker.prompts.images import ImageData
from worker.prompts.prompt import CHAT_ROLES, ChatMessage, ChatPrompt, RawPrompt
from worker.sampling.grammar import GrammarSpec
from worker.service.thinking import thinking_request
from worker.types import (
    ContentDelta,
    Event,
    Failed,
    Finished,
    FinishReason,
    Progress,
    PromptLogprobs,
    ReasoningDelta,
    RefusalDelta,
    SamplingOptions,
    Scheduling,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)

# Nesting bound of the caller's JSON (tool parameters, response schemas, template variables):
# deeper documents are refused before the chat template, llguidance or Python's recursion
# limit meet them. Schemas generated from real models nest far less.
MAX_JSON_DEPTH = 64
MAX_TENANT_CHARS = 256  # a tenant names a caller's account, not a document
_TOOL_CHOICE_MODES = frozenset(pb.ToolChoice.Mode.values())


@dataclass(frozen=True)
class ParsedRequest:
    request_id: str
    prompt: ChatPrompt | RawPrompt
    sampling: pb.SamplingParams
    return_token_ids: bool
    echo_prompt: bool
    grammar: GrammarSpec | None = None
    parse_tool_calls: bool = False
    enable_thinking: bool | None = None
    thinking_token_budget: int | None = None  # chat only: each choice's thinking cap
    reasoning_effort: str = ""  # chat only: a key of service/thinking.py EFFORT_BUDGETS, or ""
    # ``resume``: the tokens an earlier call delivered, for choice 0 (n == 1 only); () = a new request.
    resumed_token_ids: tuple[int, ...] = ()
    scheduling: Scheduling = field(default_factory=Scheduling)  # priority, tenant, the call's deadline
    stream_interval_s: float = 0.0  # ``stream_interval_ms``: at most one hand-over per this (0: each step)


@dataclass(frozen=True)
class TokenizeCall:
    """A validated Tokenize request (unset ``add_special_tokens``: Generate's rule)."""

    prompt: ChatPrompt | RawPrompt
    add_special_tokens: bool | None
    add_generation_prompt: bool
    return_token_strs: bool


def _check_model(model: str, served_model: str) -> None:
    if model and model != served_model:
        raise ModelNotFound(
            f"model {model!r} is not served here; this worker serves {served_model!r}", param="model"
        )


def _raw_prompt(prompt: pb.PromptInput) -> RawPrompt:
    if prompt.WhichOneof("prompt") == "token_ids":
        return RawPrompt(token_ids=tuple(prompt.token_ids.ids), suffix=prompt.suffix)
    return RawPrompt(text=prompt.text, suffix=prompt.suffix)


def parse_tokenize_request(request: pb.TokenizeRequest, served_model: str) -> TokenizeCall:
    """Checks the model and the input as Generate does (the same chat rules, tool choice included)."""
    _check_model(request.model, served_model)
    kind = request.WhichOneof("input")
    prompt: ChatPrompt | RawPrompt
    if kind == "chat":
        prompt = _chat_prompt(request.chat)
        _tool_choice(request.chat, prompt)
    elif kind == "prompt":
        prompt = _raw_prompt(request.prompt)
    else:
        raise InvalidRequest("the request has no input: set `prompt` or `messages`", param="prompt")
    return TokenizeCall(
        prompt=prompt,
        add_special_tokens=request.add_special_tokens if request.HasField("add_special_tokens") else None,
        add_generation_prompt=not request.HasField("add_generation_prompt") or request.add_generation_prompt,
        return_token_strs=request.return_token_strs,
    )


def parse_detokenize_request(request: pb.DetokenizeRequest, served_model: str) -> tuple[int, ...]:
    """The ids to decode (checked against the vocabulary by the renderer)."""
    _check_model(request.model, served_model)
    return tuple(request.ids)


def parse_request(
    request: pb.GenerateRequest, served_model: str, deadline: float | None = None
) -> ParsedRequest:
    """A validated ``GenerateRequest``; ``deadline``: the call's (``time.monotonic()``; None: none)."""
    _check_model(request.model, served_model)
    kind = request.WhichOneof("input")
    prompt: ChatPrompt | RawPrompt
    grammar, parse_tools, thinking = _response_format(request.response_format), False, None
    budget, effort = None, ""
    if kind == "chat":
        prompt = _chat_prompt(request.chat)
        tool_grammar, parse_tools = _tool_choice(request.chat, prompt)
        if tool_grammar is not None:
            if grammar is not None:
                raise InvalidRequest(
                    "a tool_choice that forces a call cannot be combined with a response_format constraint",
                    param="response_format",
                )
            grammar = tool_grammar
        thinking = request.chat.enable_thinking if request.chat.HasField("enable_thinking") else None
        budget, effort = thinking_request(request.chat)
    elif kind == "prompt":
        prompt = _raw_prompt(request.prompt)
    else:
        raise InvalidRequest("the request has no input: set `chat` (messages) or `prompt`", param="messages")
    resumed = _resumed_token_ids(request)
    return ParsedRequest(
        request_id=request.request_id,
        prompt=prompt,
        sampling=request.sampling,
        # Resuming implies ids: the caller tracks them to be able to resume again.
        return_token_ids=request.return_token_ids or request.HasField("resume"),
        resumed_token_ids=resumed,
        echo_prompt=request.echo_prompt,
        grammar=grammar,
        parse_tool_calls=parse_tools,
        enable_thinking=thinking,
        scheduling=_scheduling(request, deadline),
        thinking_token_budget=budget,
        reasoning_effort=effort,
        stream_interval_s=_stream_interval_s(request),
    )


def _stream_interval_s(request: pb.GenerateRequest) -> float:
    if request.stream_interval_ms > MAX_STREAM_INTERVAL_MS:
        raise InvalidRequest(
            f"stream_interval_ms must be at most {MAX_STREAM_INTERVAL_MS}, got {request.stream_interval_ms}",
            param="stream_interval_ms",
        )
    return request.stream_interval_ms / 1000.0


def _scheduling(request: pb.GenerateRequest, deadline: float | None) -> Scheduling:
    if len(request.tenant) > MAX_TENANT_CHARS:
        raise InvalidRequest(f"tenant must be at most {MAX_TENANT_CHARS} characters", param="tenant")
    return Scheduling(priority=request.priority, tenant=request.tenant, deadline=deadline)


def _resumed_token_ids(request: pb.GenerateRequest) -> tuple[int, ...]:
    """The ``resume`` field's tokens (checked against the vocabulary later, with the tokenizer)."""
    if not request.HasField("resume"):
        return ()
    choices = request.resume.choices
    n = request.sampling.n if request.sampling.HasField("n") else 1
    if n != 1 or len(choices) != 1:
        raise InvalidRequest(
            f"resume supports n = 1 only, with exactly one entry in resume.choices (got n = {n}, "
            f"{len(choices)} entries)",
            param="resume",
        )
    return tuple(choices[0].ids)


def check_resumed_tokens(token_ids: tuple[int, ...], vocab_size: int) -> None:
    """Every resumed token is in the vocabulary, else InvalidRequest naming ``resume``."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"resume: token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param="resume"
        )


def _json_object(text: str, param: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object nested at most :data:`MAX_JSON_DEPTH` deep, else
    ``InvalidRequest`` naming ``param``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{param} is not valid JSON: {exc}", param=param) from exc
    except RecursionError as exc:
        raise InvalidRequest(f"{param} is nested too deeply", param=param) from exc
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be a JSON object", param=param)
    if _depth(value) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"{param} is nested more than {MAX_JSON_DEPTH} levels deep", param=param)
    return value


def _depth(value: Any) -> int:
    """How deep objects and arrays nest in ``value`` (a scalar is 0); iterative, so any depth is safe."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        node, level = pending.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        pending.extend((child, level + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _response_format(fmt: pb.ResponseFormat) -> GrammarSpec | None:
    which = fmt.WhichOneof("format")
    if which == "json_object":
        return GrammarSpec("json_object")
    if which == "json_schema":
        param = "response_format.json_schema.schema"
        if not fmt.json_schema.schema_json:
            raise InvalidRequest(f"{param} is missing", param=param)
        return GrammarSpec(
            "json_schema", schema=_json_object(fmt.json_schema.schema_json, param), param=param
        )
    if which == "choice":
        return GrammarSpec("choice", choices=tuple(fmt.choice.choices), param="response_format.choice")
    if which in _TEXT_FORMS:
        kind, param, text = _TEXT_FORMS[which], f"response_format.{which}", getattr(fmt, which)
        if kind == "structural_tag":
            _json_object(text, param)  # the depth bound every caller-given JSON gets
        return GrammarSpec(kind, text=text, param=param)
    return None


# ResponseFormat's text fields → their grammar kind (worker.sampling.grammar_forms).
_TEXT_FORMS = {"regex": "regex", "lark": "lark", "gbnf": "gbnf", "structural_tag_json": "structural_tag"}


def _tools(chat: pb.ChatInput) -> list[dict[str, Any]]:
    tools = []
    names: set[str] = set()
    for i, tool in enumerate(chat.tools):
        if not tool.name:
            raise InvalidRequest(f"tools[{i}].function.name is missing", param=f"tools[{i}].function.name")
        if tool.name in names:
            raise InvalidRequest(f"two tools are named {tool.name!r}", param=f"tools[{i}].function.name")
        names.add(tool.name)
        params = (
            _json_object(tool.parameters_json, f"tools[{i}].function.parameters")
            if tool.parameters_json
            else {"type": "object", "properties": {}}
        )
        tools.append({"name": tool.name, "description": tool.description, "parameters": params})
    return tools


def _tool_choice(chat: pb.ChatInput, prompt: ChatPrompt) -> tuple[GrammarSpec | None, bool]:
    """Returns (the grammar that forces a call, or None; whether to parse the output for calls)."""
    choice = chat.tool_choice
    which = choice.WhichOneof("choice")
    mode = choice.mode if which == "mode" else pb.ToolChoice.MODE_UNSPECIFIED
    if mode not in _TOOL_CHOICE_MODES:  # proto3 enums are open: any int32 arrives
        raise InvalidRequest(
            f"tool_choice.mode {mode} is not a known mode (NONE, AUTO or REQUIRED)", param="tool_choice"
        )
    if not chat.tools:
        if which == "function_name" or mode == pb.ToolChoice.REQUIRED:
            raise InvalidRequest(
                "tool_choice asks for a tool call, but no tools were given", param="tool_choice"
            )
        return None, False
    if mode == pb.ToolChoice.NONE:
        return None, False
    functions = tuple((t["name"], t["parameters"]) for t in prompt.tools)
    if which == "function_name":
        chosen = tuple(f for f in functions if f[0] == choice.function_name)
        if not chosen:
            raise InvalidRequest(
                f"tool_choice names {choice.function_name!r}, which is not one of the tools",
                param="tool_choice",
            )
        return GrammarSpec("tool_call", functions=chosen, param="tool_choice"), True
    if mode == pb.ToolChoice.REQUIRED:
        spec = GrammarSpec(
            "tool_call", functions=functions, parallel=chat.parallel_tool_calls, param="tool_choice"
        )
        return spec, True
    return None, True  # auto


def _chat_prompt(chat: pb.ChatInput) -> ChatPrompt:
    if not chat.messages:
        raise InvalidRequest("messages must contain at least one message", param="messages")
    messages = []
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role is {m.role!r}; expected one of {', '.join(CHAT_ROLES)}",
                param=f"messages[{i}].role",
            )
        has_content = m.HasField("content")
        if has_content and m.parts:
            raise InvalidRequest(
                f"messages[{i}] sets both content and parts; send one of them", param=f"messages[{i}].parts"
            )
        parts = _parts(m, i)
        if not has_content and not parts and not (m.role == "assistant" and m.tool_calls):
            raise InvalidRequest(f"messages[{i}].content is missing", param=f"messages[{i}].content")
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidRequest(
                f"messages[{i}] has role 'tool' but no tool_call_id", param=f"messages[{i}].tool_call_id"
            )
        messages.append(
            ChatMessage(
                role=m.role,
                content=m.content if has_content else None,
                name=m.name,
                tool_call_id=m.tool_call_id,
                tool_calls=tuple(
                    {"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls
                ),
                reasoning_content=m.reasoning_content if m.HasField("reasoning_content") else None,
                parts=parts,
            )
        )
    kwargs: dict[str, Any] = {}
    if chat.chat_template_kwargs_json:
        kwargs = _json_object(chat.chat_template_kwargs_json, "chat_template_kwargs")
    if chat.HasField("enable_thinking"):
        kwargs["enable_thinking"] = chat.enable_thinking
    which = chat.tool_choice.WhichOneof("choice")
    none = which == "mode" and chat.tool_choice.mode == pb.ToolChoice.NONE
    forced = chat.tool_choice.function_name if which == "function_name" else ""
    if which == "mode" and chat.tool_choice.mode == pb.ToolChoice.REQUIRED:
        forced = "*"
    # tool_choice "none": the model is not told about the tools.
    tools = () if none else tuple(_tools(chat))
    return ChatPrompt(messages=tuple(messages), tools=tools, template_kwargs=kwargs, forced_tool=forced)


def _parts(message: pb.ChatMessage, index: int) -> tuple[str | ImageData, ...]:
    """A message's parts: text as str, images as :class:`ImageData` (decoded later, in the
    prepare threads, by the model's processor); an empty part is refused naming it."""
    parts: list[str | ImageData] = []
    for j, part in enumerate(message.parts):
        kind = part.WhichOneof("part")
        if kind == "text":
            parts.append(part.text)
        elif kind == "image":
            parts.append(ImageData(part.image.data, part.image.mime_type, part.image.detail))
        else:
            param = f"messages[{index}].parts[{j}]"
            raise InvalidRequest(f"{param} is empty: set text or image", param=param)
    return tuple(parts)


def _check_range(name: str, value: float, accepted: Range) -> float:
    if value not in accepted:
        raise InvalidRequest(f"{name} must be in {accepted}, got {value:g}", param=name)
    return value


def _check_token(name: str, token: int, vocab_size: int) -> int:
    if not 0 <= token < vocab_size:
        raise InvalidRequest(
            f"{name}: token id {token} is outside the vocabulary (0..{vocab_size - 1})", param=name
        )
    return token


def truncated_prompt(
    params: pb.SamplingParams, prompt_ids: tuple[int, ...], context_length: int
) -> tuple[int, ...]:
    """The prompt's last ``truncate_prompt_tokens`` tokens (all of them when unset); -1 keeps as many as
    leave room for ``max_tokens`` (else one token) in the context. Raises InvalidRequest for 0 or < -1."""
    if not params.HasField("truncate_prompt_tokens"):
        return prompt_ids
    keep = params.truncate_prompt_tokens
    if keep == -1:
        room = params.max_tokens if params.HasField("max_tokens") and params.max_tokens > 0 else 1
        keep = max(1, context_length - room)
    if keep < 1:
        raise InvalidRequest(
            f"truncate_prompt_tokens must be -1 or at least 1, got {keep}", param="truncate_prompt_tokens"
        )
    return prompt_ids[-keep:]


def _bad_words(
    words: Sequence[str], encode: Callable[[str], Sequence[int]] | None
) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences: the word as written and with one leading space (its form
    inside a sentence), duplicates dropped."""
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequest(f"at most {MAX_BAD_WORDS} bad_words, got {len(words)}", param="bad_words")
    for i, word in enumerate(words):
        if not word.strip():
            raise InvalidRequest(f"bad_words[{i}] is empty or only spaces", param="bad_words")
    if not words:
        return ()
    if encode is None:
        raise RuntimeError("bad_words need the tokenizer's encode")
    forms: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(encode(text))
            if ids:
                forms[ids] = None
    return tuple(forms)


def sampling_options(
    params: pb.SamplingParams,
    *,
    prompt_tokens: int,
    context_length: int,
    vocab_size: int,
    max_n: int = MAX_N,
    default_max_tokens: int | None = None,
    encode: Callable[[str], Sequence[int]] | None = None,
) -> SamplingOptions:
    """Validates sampling fields against the model and resolves max_tokens (``encode``: the
    tokenizer's, for ``bad_words``)."""
    if prompt_tokens >= context_length:
        raise InvalidRequest(
            f"the prompt is {prompt_tokens} tokens; this model's context length is {context_length} "
            "tokens, which must also leave room for at least one completion token",
            param="messages",
        )
    room = context_length - prompt_tokens
    prompt_logprobs = params.prompt_logprobs if params.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}",
            param="prompt_logprobs",
        )
    if params.HasField("max_tokens"):
        max_tokens = params.max_tokens
        # 0 only scores the prompt, which needs its logprobs asked for.
        least = 0 if prompt_logprobs is not None else 1
        if max_tokens < least:
            raise InvalidRequest(
                f"max_tokens must be at least {least}, got {max_tokens}"
                + ("" if least == 0 else " (0 is allowed only with prompt_logprobs)"),
                param="max_tokens",
            )
        if max_tokens > room:
            raise InvalidRequest(
                f"max_tokens is {max_tokens}, but the context length is {context_length} tokens and the "
                f"prompt uses {prompt_tokens}: at most {room} completion tokens fit",
                param="max_tokens",
            )
    else:
        max_tokens = min(room, default_max_tokens) if default_max_tokens else room
    min_tokens = params.min_tokens if params.HasField("min_tokens") else 0
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequest(
            f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}", param="min_tokens"
        )
    n = params.n if params.HasField("n") else 1
    if not 1 <= n <= max_n:
        raise InvalidRequest(f"n must be in [1, {max_n}], got {n}", param="n")
    logprobs = params.logprobs if params.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", param="top_logprobs"
        )
    top_k = params.top_k if params.HasField("top_k") else 0
    if top_k < -1:
        raise InvalidRequest(f"top_k must be -1, 0 (off) or positive, got {top_k}", param="top_k")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}", param="stop")
    for i, stop in enumerate(params.stop):
        if not stop:
            raise InvalidRequest(f"stop[{i}] is an empty string", param="stop")
    bias = []
    for token, value in sorted(params.logit_bias.items()):
        _check_token("logit_bias", token, vocab_size)
        bias.append((token, _check_range("logit_bias", value, LOGIT_BIAS)))
    bad_words = _bad_words(params.bad_words, encode)
    allowed = tuple(
        sorted({_check_token("allowed_token_ids", t, vocab_size) for t in params.allowed_token_ids})
    )
    if allowed and set(allowed) <= {word[0] for word in bad_words if len(word) == 1}:
        raise InvalidRequest("bad_words ban every one of allowed_token_ids", param="bad_words")
    return SamplingOptions(
        temperature=_check_range("temperature", params.temperature, TEMPERATURE)
        if params.HasField("temperature")
        else 1.0,
        top_p=_check_range("top_p", params.top_p, TOP_P) if params.HasField("top_p") else 1.0,
        top_k=max(top_k, 0),
        min_p=_check_range("min_p", params.min_p, MIN_P) if params.HasField("min_p") else 0.0,
        seed=params.seed if params.HasField("seed") else None,
        presence_penalty=_check_range("presence_penalty", params.presence_penalty, PENALTY)
        if params.HasField("presence_penalty")
        else 0.0,
        frequency_penalty=_check_range("frequency_penalty", params.frequency_penalty, PENALTY)
        if params.HasField("frequency_penalty")
        else 0.0,
        repetition_penalty=_check_range("repetition_penalty", params.repetition_penalty, REPETITION_PENALTY)
        if params.HasField("repetition_penalty")
        else 1.0,
        logit_bias=tuple(bias),
        stop=tuple(params.stop),
        stop_token_ids=tuple(_check_token("stop_token_ids", t, vocab_size) for t in params.stop_token_ids),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=params.ignore_eos,
        n=n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        bad_words=bad_words,
        allowed_token_ids=allowed,
        skip_special_tokens=params.skip_special_tokens if params.HasField("skip_special_tokens") else None,
        include_stop_str_in_output=params.include_stop_str_in_output,
        speculative=params.speculative if params.HasField("speculative") else True,
    )


# ---------------------------------------------------------------- outgoing

_FINISH = {
    FinishReason.STOP: pb.STOP,
    FinishReason.LENGTH: pb.LENGTH,
    FinishReason.TOOL_CALLS: pb.TOOL_CALLS,
    FinishReason.CONTENT_FILTER: pb.CONTENT_FILTER,
}
_STAGES = {
    "queued": pb.Progress.QUEUED,
    "model_load": pb.Progress.MODEL_LOAD,
    "prompt_processing": pb.Progress.PROMPT_PROCESSING,
}


def _logprobs(entries: tuple[TokenLogprob, ...]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token=e.token,
            logprob=e.logprob,
            bytes=e.token_bytes,
            token_id=e.token_id,
            top_logprobs=[
                pb.TopLogprob(token=t.token, logprob=t.logprob, bytes=t.token_bytes, token_id=t.token_id)
                for t in e.top
            ],
        )
        for e in entries
    ]


def event_to_proto(event: Event) -> pb.GenerateResponse:
    """Converts one internal event; ``Failed`` is not an event on the wire (it ends the call)."""
    match event:
        case ContentDelta():
            message = pb.GenerateResponse()
            content = message.content  # filled in place: no nested message copied
            content.choice_index, content.text = event.choice_index, event.text
            if event.token_ids:  # most deltas carry neither: no empty fields to build
                content.token_ids.extend(event.token_ids)
            if event.logprobs:
                content.logprobs.extend(_logprobs(event.logprobs))
            return message
        case ReasoningDelta():
            return pb.GenerateResponse(
                reasoning=pb.ReasoningDelta(
                    choice_index=event.choice_index,
                    text=event.text,
                    token_ids=event.token_ids,
                    logprobs=_logprobs(event.logprobs),
                )
            )
        case RefusalDelta():
            return pb.GenerateResponse(
                refusal=pb.RefusalDelta(
                    choice_index=event.choice_index, text=event.text, logprobs=_logprobs(event.logprobs)
                )
            )
        case ToolCallDelta():
            return pb.GenerateResponse(
                tool_call=pb.ToolCallDelta(
                    choice_index=event.choice_index,
                    tool_index=event.tool_index,
                    id=event.call_id,
                    name=event.name,
                    arguments=event.arguments,
                    token_ids=event.token_ids,
                )
            )
        case Progress():
            return pb.GenerateResponse(
                progress=pb.Progress(stage=_STAGES[event.stage], fraction=event.fraction)
            )
        case Finished():
            finished = pb.Finished(
                choice_index=event.choice_index,
                reason=_FINISH[event.reason],
                matched_stop=event.matched_stop,
                completion_tokens=event.completion_tokens,
                timings=pb.Timings(
                    queue_seconds=event.timings.queue_seconds,
                    time_to_first_token_seconds=event.timings.time_to_first_token_seconds,
                    decode_seconds=event.timings.decode_seconds,
                ),
            )
            if event.matched_stop_token_id is not None:
                finished.matched_stop_token_id = event.matched_stop_token_id
            return pb.GenerateResponse(finished=finished)
        case Usage():
            return pb.GenerateResponse(
                usage=pb.Usage(
                    prompt_tokens=event.prompt_tokens,
                    completion_tokens=event.completion_tokens,
                    total_tokens=event.total_tokens,
                    cached_tokens=event.cached_tokens,
                    reasoning_tokens=event.reasoning_tokens,
                )
            )
        case PromptLogprobs():
            return pb.GenerateResponse(
                prompt_logprobs=pb.PromptLogprobs(
                    logprobs=_logprobs(event.logprobs),
                    first_token=event.first_token,
                    first_token_bytes=event.first_token_bytes,
                    first_token_id=event.first_token_id,
                )
            )
        case Failed():
            raise TypeError("Failed ends the call with a status; it has no wire event")
    raise TypeError(f"unknown event {event!r}")
