"""Grammar-constrained decoding with llguidance (see docs/constrained-decoding.md for the choice).

Design notes: docs/worker.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import torch

from worker.errors import InvalidRequest
from worker.formats.declaration import TaggedCall
from worker.formats.registry import CALL_GRAMMARS, call_grammar
from worker.sampling.grammar_forms import (
    choice_grammar,
    gbnf_grammar,
    lark_grammar,
    regex_grammar,
    structural_tag_grammar,
    text_lark,
)

COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint, before compilation."""

    # "json_object", "json_schema", "tool_call", or a caller-written form (grammar_forms):
    # "choice", "regex", "lark", "gbnf", "structural_tag"
    kind: str
    schema: dict[str, Any] | None = None  # json_schema: the schema
    text: str = ""  # regex, lark, gbnf: the text; structural_tag: its JSON
    choices: tuple[str, ...] = ()  # choice: the strings
    functions: tuple[tuple[str, dict[str, Any]], ...] = ()  # tool_call: (name, parameters schema)
    parallel: bool = False  # tool_call: allow several calls
    call_format: str = "hermes"  # tool_call: the family's call format (worker/formats/ declares each)
    param: str = "response_format"  # the request field to name in errors


# Keywords whose values are data, not schemas: a {"$ref": ...} inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_DEFS_KEYWORDS = ("$defs", "definitions")


def embed_schema(schema: dict[str, Any], prefix: str, root_defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` rewritten to be embedded anywhere in a larger document whose root ``$defs`` is
    ``root_defs`` (filled here, under names starting with ``prefix``; the caller picks a prefix
    unique per embedded schema).

    Local references (``#...``) keep their meaning; remote ones are left as they are.
    ``schema`` is not modified.
    """
    names: dict[tuple[str, str], str] = {}
    for keyword in _DEFS_KEYWORDS:
        for name in schema.get(keyword) or {}:
            names[(keyword, name)] = f"{prefix}{keyword.strip('$')}_{len(names)}"
    whole = f"{prefix}root"
    needs_whole = False

    def new_ref(ref: str) -> str:
        nonlocal needs_whole
        if ref != "#" and not ref.startswith("#/"):
            return ref  # remote, or an anchor: not a JSON pointer into this schema
        parts = ref[2:].split("/", 2) if ref != "#" else []
        if len(parts) >= 2:
            keyword, name = parts[0], unquote(parts[1]).replace("~1", "/").replace("~0", "~")
            if (keyword, name) in names:
                rest = f"/{parts[2]}" if len(parts) == 3 else ""
                return f"#/$defs/{names[(keyword, name)]}{rest}"
        needs_whole = True
        return f"#/$defs/{whole}{ref[1:]}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = new_ref(value)
            elif key in _DATA_KEYWORDS:
                out[key] = value
            else:
                out[key] = rewrite(value)
        return out

    body = {k: v for k, v in schema.items() if k not in (*_DEFS_KEYWORDS, "$schema", "$id")}
    embedded = rewrite(body)
    for (keyword, name), new_name in names.items():
        root_defs[new_name] = rewrite(schema[keyword][name])
    if needs_whole:
        root_defs[whole] = embedded
    return embedded


def _call_schema(
    name: str, parameters: dict[str, Any], prefix: str, root_defs: dict[str, Any], key: str = "arguments"
) -> dict:
    arguments = embed_schema(parameters, prefix, root_defs) if parameters else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
    }


def tool_call_schema(
    functions: tuple[tuple[str, dict[str, Any]], ...], key: str = "arguments"
) -> dict[str, Any]:
    """The schema of one call to any of ``functions`` ((name, parameters schema) pairs), every
    parameter schema embedded with :func:`embed_schema` (prefix ``t<index>_``)."""
    root_defs: dict[str, Any] = {}
    calls = [
        _call_schema(name, params, f"t{i}_", root_defs, key) for i, (name, params) in enumerate(functions)
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if root_defs:
        schema = {**schema, "$defs": root_defs}
    return schema


def _pieces(parts: tuple[str, ...], name: str, specials: Mapping[str, int]) -> str:
    """Lark for a marker sequence: a special token as ``<[id]>``, text as a quoted literal."""
    out = []
    for part in parts:
        text = part.replace("{name}", name)
        out.append(f"<[{specials[text]}]>" if text in specials else json.dumps(text))
    return " ".join(out) if out else '""'


def call_markers() -> set[str]:
    """Every marker of every forced-call format (for looking up which are single tokens)."""
    return {marker for grammar in CALL_GRAMMARS.values() for marker in grammar.markers}


def _tagged_lark(spec: GrammarSpec, form: TaggedCall, specials: Mapping[str, int]) -> str:
    """A forced call in a tagged format: the required parameters in order, then each optional one
    or not (``every_parameter``: all of them), every value the JSON of its property's schema."""
    rules = []
    for i, (name, params) in enumerate(spec.functions):
        root_defs: dict[str, Any] = {}
        embedded = embed_schema(params, f"t{i}_", root_defs) if params else {}
        properties = embedded.get("properties") or {}
        required = [k for k in embedded.get("required") or [] if k in properties]
        if form.every_parameter:
            required = list(properties)
        order = required + [k for k in properties if k not in required]
        parts = []
        for j, key in enumerate(order):
            schema = properties[key]
            if root_defs:
                schema = {**schema, "$defs": root_defs}
            rules.append(f"v{i}_{j}: %json {json.dumps({**schema, 'x-guidance': COMPACT})}\n")
            lead = form.parameter_separator if j else ""
            piece = f"{text_lark(lead + form.key_start.replace('{key}', key), specials)} v{i}_{j}"
            piece += f" {text_lark(form.key_end, specials)}" if form.key_end else ""
            parts.append(piece if key in required else f"({piece})?")
        body = " ".join(parts) if parts else '""'
        head = text_lark(form.start.replace("{name}", name), specials)
        rules.append(f"call{i}: {head} {body} {text_lark(form.end, specials)}\n")
    call = " | ".join(f"call{i}" for i in range(len(spec.functions)))
    sep = text_lark(form.separator, specials)
    top = f"call ({sep} call)*" if spec.parallel else "call"
    opening, closing = form.around
    if opening or closing:
        top = f"{text_lark(opening, specials)} {top} {text_lark(closing, specials)}"
    return f"start: {top}\ncall: {call}\n" + "".join(rules)


def _tool_call_lark(spec: GrammarSpec, specials: Mapping[str, int]) -> str:
    form = call_grammar(spec.call_format)
    if isinstance(form, TaggedCall):
        return _tagged_lark(spec, form, specials)
    before, after, key = form.before, form.after, form.key
    named = any("{name}" in part for part in before)
    rules = []
    for i, (name, params) in enumerate(spec.functions):
        if named:
            root_defs: dict[str, Any] = {}
            schema = embed_schema(params, f"t{i}_", root_defs) if params else {"type": "object"}
            schema = {**schema, "$defs": root_defs} if root_defs else schema
        else:
            schema = tool_call_schema(((name, params),), key)
        body = json.dumps({**schema, "x-guidance": COMPACT})
        rules.append(f"call{i}: {_pieces(before, name, specials)} body{i} {_pieces(after, name, specials)}\n")
        rules.append(f"body{i}: %json {body}\n")
    call = " | ".join(f"call{i}" for i in range(len(spec.functions)))
    separator = json.dumps(form.separator)
    start = f"call ({separator} call)*" if spec.parallel else "call"
    return f"start: {start}\ncall: {call}\n" + "".join(rules)


# What each kind's compile error calls the caller's constraint.
_WHAT = {
    "choice": "the choices",
    "regex": "the regular expression",
    "lark": "the grammar",
    "gbnf": "the grammar",
    "structural_tag": "the structural tag",
}


def lark_source(spec: GrammarSpec, specials: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar (Lark, or its JSON form) for a spec; ``specials``: markers that are
    one special token. Raises InvalidRequest for caller-written text that is no grammar."""
    if spec.kind == "choice":
        return choice_grammar(spec.choices, spec.param)
    if spec.kind == "regex":
        return regex_grammar(spec.text, spec.param)
    if spec.kind == "lark":
        return lark_grammar(spec.text, spec.param)
    if spec.kind == "gbnf":
        return gbnf_grammar(spec.text, spec.param)
    if spec.kind == "structural_tag":
        return structural_tag_grammar(spec.text, spec.param, specials or {}, COMPACT)
    if spec.kind == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    elif spec.kind == "json_schema":
        schema = dict(spec.schema or {})
    elif spec.kind == "tool_call":
        return _tool_call_lark(spec, specials or {})
    else:
        raise ValueError(f"unknown grammar kind {spec.kind!r}")
    return f"start: body\nbody: %json {json.dumps({**schema, 'x-guidance': COMPACT})}\n"


class TokenConstraint:
    """One choice's grammar state."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    @property
    def mask_words(self) -> int:
        """The int32 words of one packed mask: ``ceil(vocab / 32)`` for the grammar's vocabulary."""
        return (self._vocab_size + 31) // 32

    def fill_mask(self, row: torch.Tensor) -> None:
        """Writes the allowed-token bitmask into ``row``, a contiguous int32 CPU tensor of
        :attr:`mask_words` words (bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed)."""
        if row.dtype != torch.int32 or not row.is_contiguous() or row.numel() != self.mask_words:
            raise ValueError(f"the mask row must be {self.mask_words} contiguous int32 words")
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self._matcher.is_error():
            raise RuntimeError(f"grammar error: {self._matcher.get_error()}")

    def advance(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar would take from its state (none consumed)."""
        try:
            return int(self._matcher.validate_tokens(tokens))
        except Exception:  # a matcher in error: its row fails at its next mask anyway
            return 0

    @property
    def error(self) -> str | None:
        """Why the matcher failed (e.g. it was given a token the grammar does not allow), or None."""
        return str(self._matcher.get_error()) if self._matcher.is_error() else None

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the choice should end)."""
        return bool(self._matcher.is_stopped())


class GrammarCompiler:
    """Builds llguidance matchers for one tokenizer (the tokenizer table is built once, lazily)."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int]):
        self._hf_tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._marker_ids: dict[str, int] | None = None
        self._added: dict[str, int] | None = None
        self.vocab_size = len(tokenizer)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens included (a thinking budget's markers)."""
        return str(self._hf_tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = _ll_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos)
        return self._ll_tokenizer

    def _specials(self) -> dict[str, int]:
        """The call markers that this vocabulary has as one added token (written ``<[id]>``)."""
        if self._marker_ids is None:
            added = self._added_tokens()
            self._marker_ids = {m: added[m] for m in call_markers() if m in added}
        return self._marker_ids

    def _added_tokens(self) -> dict[str, int]:
        """Every added token of the vocabulary (a structural tag's markers may be any of them)."""
        if self._added is None:
            self._added = dict(getattr(self._hf_tokenizer, "get_added_vocab", dict)())
        return self._added

    def prepare(self) -> None:
        """Builds the tokenizer table and the marker lookup now (at load): built on a request's path,
        a large vocabulary's table (Gemma 3's 262k tokens) stalls the worker for many seconds (seen
        built lazily: the worker's health checks missed their deadline and the edge ejected it)."""
        self._tokenizer()
        self._specials()
        self._added_tokens()

    def validate(self, spec: GrammarSpec) -> str:
        """Checks the spec compiles; returns the grammar source, or raises InvalidRequest naming the field."""
        import llguidance

        specials = self._added_tokens() if spec.kind == "structural_tag" else self._specials()
        source = lark_source(spec, specials)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self._tokenizer())
        what = _WHAT.get(spec.kind, "the schema")
        if is_error:
            raise InvalidRequest(
                f"{what} cannot be used for constrained decoding: {messages[0]}", param=spec.param
            )
        if spec.kind in _WHAT:  # caller-written: one that allows no first token fails at admission
            first = self.constraint(source)
            try:
                first.fill_mask(torch.zeros(first.mask_words, dtype=torch.int32))
            except RuntimeError:
                raise InvalidRequest(f"{what} allows no output at all", param=spec.param) from None
        return source

    def constraint(self, source: str) -> TokenConstraint:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), source, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"the grammar failed to compile: {matcher.get_error()}", param="response_format"
            )
        return TokenConstraint(matcher, self.vocab_size)


def _ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos: list[int]) -> Any:
    """llguidance's table of a fast tokenizer. Its serialized form is read directly when the
    tokenizer pads and truncates nothing (llguidance's own helper copies the tokenizer first, a
    pickle round trip costing half a second for a 150k vocabulary)."""
    import llguidance
    import llguidance.hf

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    eos_token = eos[0] if eos else getattr(hf_tokenizer, "eos_token_id", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token)
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token)
