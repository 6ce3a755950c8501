"""Grammar-constrained decoding with llguidance (see docs/constrained-decoding.md for the choice).

:class:`GrammarCompiler` (one per worker) turns a request's constraint into an
llguidance grammar and makes one :class:`TokenConstraint` per choice. Each
step the sampler masks the logits with :meth:`TokenConstraint.allowed` before
drawing, and the engine feeds the drawn token to :meth:`TokenConstraint.advance`.

Constraints:

- ``json_object``: any JSON object;
- ``json_schema``: JSON that validates against the schema;
- ``tool_call``: one (or, with parallel calls, one or more)
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks whose
  name is one of the allowed functions and whose arguments validate against
  that function's parameter schema. This is the format the tool-call parser
  reads, so forced calls stream like any other.

JSON is generated compactly (no free white space): small models otherwise
tend to emit white space forever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from worker.errors import InvalidRequest

COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint, before compilation."""

    kind: str  # "json_object", "json_schema" or "tool_call"
    schema: dict[str, Any] | None = None  # json_schema: the schema
    functions: tuple[tuple[str, dict[str, Any]], ...] = ()  # tool_call: (name, parameters schema)
    parallel: bool = False  # tool_call: allow several calls
    param: str = "response_format"  # the request field to name in errors


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def lark_source(spec: GrammarSpec) -> str:
    """The llguidance Lark grammar for a spec."""
    if spec.kind == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    elif spec.kind == "json_schema":
        schema = dict(spec.schema or {})
    elif spec.kind == "tool_call":
        calls = [_call_schema(name, params) for name, params in spec.functions]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = json.dumps({**schema, "x-guidance": COMPACT})
        start = 'call ("\\n" call)*' if spec.parallel else "call"
        return f'start: {start}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {body}\n'
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
        self.vocab_size = len(tokenizer)

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos[0] if self._eos else None
            )
        return self._ll_tokenizer

    def validate(self, spec: GrammarSpec) -> str:
        """Checks the spec compiles; returns the grammar source, or raises InvalidRequest naming the field."""
        import llguidance

        source = lark_source(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self._tokenizer())
        if is_error:
            raise InvalidRequest(
                f"the schema cannot be used for constrained decoding: {messages[0]}", param=spec.param
            )
        return source

    def constraint(self, source: str) -> TokenConstraint:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), source, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"the grammar failed to compile: {matcher.get_error()}", param="response_format"
            )
        return TokenConstraint(matcher, self.vocab_size)
