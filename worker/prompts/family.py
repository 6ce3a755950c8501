"""The model family's formats, chosen once at load from its ``model_type`` and what its chat template
renders (probed with a sentinel tool and call, as llama.cpp does): parsers, the thinking switch,
where earlier reasoning goes, the tool-call id rule, extra stop tokens, special-token decoding.
"""

from __future__ import annotations

import hashlib
import json
import logging
import string
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from worker.formats.declaration import ReasoningFormat, ToolFormat
from worker.formats.registry import REASONING_FORMATS, TOOL_FORMATS
from worker.model.mistral_tokenizer import mistral_common_of
from worker.prompts.mistral_prompt import mistral_thinks
from worker.prompts.template_fixes import fix_template
from worker.prompts.vocabulary import TokenIndex

log = logging.getLogger(__name__)

PROBE_TOOL = "sluice_probe_tool"
PROBE_DESCRIPTION = "sluice probe description"
PROBE_ID = "sluiceab1"  # nine alphanumerics: what Mistral's templates require
PROBE_ARG = "sluice_probe_value"
PROBE_THOUGHT = "sluice probe thought"


@dataclass(frozen=True)
class FamilyProfile:
    """How one model's prompts are rendered and its output parsed."""

    family: str  # what was recognised ("unknown": today's behaviour)
    tool_parser: str = "hermes"  # a worker/formats/ name ("hermes": also bare JSON)
    call_grammar: str = "hermes"  # the forced-call grammar: the format's or its variant's name
    reasoning_parser: str | None = None
    thinking_switch: str = "enable_thinking"  # the template variable that turns thinking on/off
    reasoning_field: str = "reasoning_content"  # where the template reads earlier reasoning
    template_tools: bool = False  # the template renders tools itself (else the built-in prompt)
    tools_in_system: bool = False  # the template reads tools from the system message
    nine_char_ids: bool = False  # tool-call ids must be nine alphanumerics (Mistral)
    arguments_as_text: bool = False  # the template wants a call's arguments as JSON text
    null_call_content: bool = False  # the template renders a call only when the content is null
    template_calls: bool = False  # the template renders earlier calls in a known format
    stop_tokens: tuple[str, ...] = ()
    keep_special_tokens: bool = False
    template: str | None = None  # a --chat-template file's text, or the patched template
    template_patched: bool = False  # known defects fixed (worker.prompts.template_fixes)
    default_kwargs: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The choice, as logged and shown in the model metadata."""
        shown = asdict(self)
        shown.pop("template")
        shown["chat_template"] = "file" if self.template else "tokenizer"
        if self.template_patched:
            shown["chat_template"] += " (patched)"
        return shown


def nine_char_id(call_id: str) -> str:
    """A client's tool-call id as nine alphanumerics (stable, so a call and its result match)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    digest = int(hashlib.sha256(call_id.encode()).hexdigest(), 16)
    alphabet = string.ascii_letters + string.digits
    out = ""
    for _ in range(9):
        digest, index = divmod(digest, len(alphabet))
        out += alphabet[index]
    return out


class _Probe:
    """Renders small conversations with the template; a template error counts as "not rendered"."""

    def __init__(self, tokenizer: Any, template: str | None):
        self._tokenizer = tokenizer
        self._template = template

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if self._template is not None:
            kwargs["chat_template"] = self._template
        try:
            return str(self._tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))
        except Exception:  # any template failure just means "not this way"
            return ""


_USER = {"role": "user", "content": "hi"}
_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_TOOL,
        "description": PROBE_DESCRIPTION,
        "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
    },
}


def _call_turn(
    call_id: str, arguments_as_text: bool = False, null_content: bool = False
) -> list[dict[str, Any]]:
    arguments: Any = {"arg": PROBE_ARG}
    if arguments_as_text:
        arguments = json.dumps(arguments)
    call = {"id": call_id, "type": "function", "function": {"name": PROBE_TOOL, "arguments": arguments}}
    return [
        _USER,
        {"role": "assistant", "content": None if null_content else "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "name": PROBE_TOOL, "content": "ok"},
    ]


# The formats in the order their probes are tried (worker/formats/declaration.py: CallProbe).
_CALL_PROBES = sorted(TOOL_FORMATS.values(), key=lambda tool: (tool.probe.rank, tool.name))
_THINKING_PROBES = sorted(REASONING_FORMATS.values(), key=lambda thinking: (thinking.rank, thinking.name))


def _call_format(rendered: str) -> str | None:
    """The tool-call format a rendered assistant call is in: the first whose probe markers all show."""
    return next(
        (
            tool.name
            for tool in _CALL_PROBES
            if all(marker.replace("{tool}", PROBE_TOOL) in rendered for marker in tool.probe.markers)
        ),
        None,
    )


def _model_type_calls(model_type: str) -> str:
    """The format a model type writes when its template renders no earlier call (hermes otherwise)."""
    base = model_type.split("moe")[0].rstrip("_")
    return next((tool.name for tool in TOOL_FORMATS.values() if base in tool.model_types), "hermes")


def _is_special(tokenizer: Any, marker: str) -> bool:
    ids = tokenizer.convert_tokens_to_ids([marker])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    token = decoder.get(ids[0]) if ids and isinstance(ids[0], int) else None
    return bool(token is not None and getattr(token, "special", False) and token.content == marker)


def _reasoning(model_type: str, template: str, tokenizer: Any) -> str | None:
    """The thinking format the model type, template and vocabulary show (None: it does not think)."""
    vocab = TokenIndex(tokenizer)
    return next(
        (thinking.name for thinking in _THINKING_PROBES if thinking.shown(model_type, template, vocab)), None
    )


def _declared(tool_parser: str, reasoning: str | None) -> list[ToolFormat | ReasoningFormat]:
    """The chosen formats' declarations (a name no file declares has none)."""
    found = (REASONING_FORMATS.get(reasoning or ""), TOOL_FORMATS.get(tool_parser))
    return [declared for declared in found if declared is not None]


def _markers(tool_parser: str, reasoning: str | None) -> tuple[str, ...]:
    """The markers the chosen formats' parsers read."""
    return tuple(marker for declared in _declared(tool_parser, reasoning) for marker in declared.markers)


def _stop_tokens(tool_parser: str, reasoning: str | None) -> tuple[str, ...]:
    """The tokens besides EOS that end a turn in the chosen formats."""
    stops = (token for declared in _declared(tool_parser, reasoning) for token in declared.stop_tokens)
    return tuple(dict.fromkeys(stops))


def _thinking_switch(probe: _Probe) -> str:
    for name, off, on in (
        ("enable_thinking", False, True),
        ("thinking", False, True),
        ("reasoning_effort", "low", "high"),
    ):
        a = probe.render([_USER], add_generation_prompt=True, **{name: off})
        if a and a != probe.render([_USER], add_generation_prompt=True, **{name: on}):
            return name
    return "enable_thinking"


def _reasoning_field(probe: _Probe, arguments_as_text: bool) -> str:
    """The message key the template shows earlier reasoning from (tried where templates keep it:
    the last assistant turn, and a turn with a tool call)."""
    for name in ("reasoning_content", "thinking", "reasoning"):
        last = [_USER, {"role": "assistant", "content": "done", name: PROBE_THOUGHT}]
        calling = _call_turn(PROBE_ID, arguments_as_text)
        calling[1] = {**calling[1], name: PROBE_THOUGHT}
        if any(PROBE_THOUGHT in probe.render(m, tools=[_TOOL]) for m in (last, calling)):
            return name
    return "reasoning_content"


def _mistral_common_profile(mistral: Any, tokenizer: Any) -> FamilyProfile:
    """A tekken tokenizer's formats, from its mistral-common version and special tokens (its chats are
    encoded by mistral-common, worker/prompts/mistral_prompt.py)."""
    inner = mistral.instruct_tokenizer.tokenizer
    specials = inner._special_tokens_reverse_vocab
    named = TOOL_FORMATS["mistral"].variant  # v11 and later: [TOOL_CALLS]NAME[ARGS]{...}
    assert named is not None
    v11 = named.marker in specials and inner.version.value not in ("v1", "v2", "v3", "v7")
    return FamilyProfile(
        family="mistral",
        tool_parser="mistral",
        call_grammar=named.name if v11 else "mistral",
        reasoning_parser="mistral" if mistral_thinks(mistral) else None,
        template_tools=True,
        nine_char_ids=True,
        keep_special_tokens=any(_is_special(tokenizer, m) for m in _markers("mistral", "mistral")),
    )


def choose_profile(
    model_type: str,
    tokenizer: Any,
    *,
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
    template: str | None = None,
    default_kwargs: dict[str, Any] | None = None,
) -> FamilyProfile:
    """The profile for a loaded tokenizer; settings other than "auto" win over what is probed."""
    mistral = mistral_common_of(tokenizer)
    if mistral is not None and template is None:
        profile = _mistral_common_profile(mistral, tokenizer)
        if tool_call_parser != "auto":
            profile = replace(profile, tool_parser=tool_call_parser, call_grammar=tool_call_parser)
        if reasoning_parser != "auto":
            reasoning = None if reasoning_parser == "none" else reasoning_parser
            profile = replace(profile, reasoning_parser=reasoning)
        profile = replace(profile, default_kwargs=dict(default_kwargs or {}))
        log.info("chat formats for model type %r: %s", model_type, json.dumps(profile.summary()))
        return profile
    source = template if template is not None else getattr(tokenizer, "chat_template", None)
    source = source if isinstance(source, str) else ""
    fixed = fix_template(source) if source else source
    if fixed != source:
        template = fixed
    probe = _Probe(tokenizer, template)
    with_tools = probe.render([_USER], tools=[_TOOL], add_generation_prompt=True)
    in_system = [{"role": "system", "content": "s", "tools": json.dumps([_TOOL])}, _USER]
    tools_in_system = PROBE_DESCRIPTION not in with_tools and PROBE_DESCRIPTION in probe.render(in_system)
    # Some templates (DeepSeek's) concatenate the arguments, so they need JSON text; DeepSeek V3's
    # renders a call only when the message's content is null.
    call, as_text, null_content = "", False, False
    for as_text, null_content in ((False, False), (True, False), (False, True), (True, True)):
        call = probe.render(_call_turn(PROBE_ID, as_text, null_content), tools=[_TOOL])
        if PROBE_ARG in call:
            break
    else:
        call = probe.render(_call_turn(PROBE_ID), tools=[_TOOL])
        as_text, null_content = False, False
    turn = _call_turn("call_" + "0" * 24, as_text, null_content)
    sluice_ids_work = bool(probe.render(turn, tools=[_TOOL]))
    detected = _call_format(call) if PROBE_ARG in call else None
    # A template that renders no earlier call says nothing of the format: the model type may.
    tool_parser = detected or _model_type_calls(model_type)
    if tool_call_parser not in ("auto", "none"):
        tool_parser = tool_call_parser
    reasoning = _reasoning(model_type, source, tokenizer) if source or model_type else None
    if reasoning_parser != "auto":
        reasoning = None if reasoning_parser == "none" else reasoning_parser
    grammar = tool_parser
    variant = TOOL_FORMATS[tool_parser].variant if tool_parser in TOOL_FORMATS else None
    if variant is not None and variant.marker in (call or source):
        grammar = variant.name
    family = detected or reasoning or "unknown"
    profile = FamilyProfile(
        family=family,
        tool_parser="none" if tool_call_parser == "none" else tool_parser,
        call_grammar=grammar,
        reasoning_parser=reasoning,
        thinking_switch=_thinking_switch(probe),
        reasoning_field=_reasoning_field(probe, as_text),
        arguments_as_text=as_text and PROBE_ARG in call,
        null_call_content=null_content and PROBE_ARG in call,
        template_calls=detected is not None,
        template_tools=PROBE_DESCRIPTION in with_tools or tools_in_system,
        tools_in_system=tools_in_system,
        nine_char_ids=bool(call) and not sluice_ids_work,
        stop_tokens=_stop_tokens(tool_parser, reasoning),
        keep_special_tokens=any(_is_special(tokenizer, m) for m in _markers(tool_parser, reasoning)),
        template=template,
        template_patched=fixed != source,
        default_kwargs=dict(default_kwargs or {}),
    )
    if family == "unknown":
        log.info(
            "model type %r: no known tool-call or reasoning format in its chat template; "
            "using Sluice's built-in tool prompt and <tool_call> parser",
            model_type,
        )
    log.info("chat formats for model type %r: %s", model_type, json.dumps(profile.summary()))
    return profile
