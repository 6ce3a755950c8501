"""The caller-written constraint forms as llguidance grammars: a choice of strings, a regular
expression, Lark, GBNF (translated to Lark) and vLLM's structural tag.

Each function raises InvalidRequest naming ``param`` for text it cannot turn into a grammar.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from worker.errors import InvalidRequest

# Free text between structural tags: anything, newlines included.
_FREE_TEXT = "TAG_TEXT: /(.|\\n)*/"


def choice_grammar(choices: tuple[str, ...], param: str) -> str:
    """Lark: the whole output is one of ``choices``."""
    if not choices:
        raise InvalidRequest("the choice list is empty; give at least one string", param=param)
    import llguidance

    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n"))


def regex_grammar(pattern: str, param: str) -> str:
    """The whole output matches ``pattern`` (Rust ``regex`` syntax)."""
    if not pattern:
        raise InvalidRequest("the regular expression is empty", param=param)
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_regex(pattern))


def lark_grammar(text: str, param: str) -> str:
    """A Lark grammar as given; text without a ``start:`` rule (or ``%llguidance``) is read as
    GBNF, as vLLM's llguidance backend does."""
    from llguidance.gbnf_to_lark import is_lark_syntax

    if not text.strip():
        raise InvalidRequest("the grammar is empty", param=param)
    if not is_lark_syntax(text):
        return gbnf_grammar(text, param)
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_lark(text))


# GBNF constructs llguidance's translator has no Lark for, by the character it stops at.
_UNTRANSLATED = {
    "<": "token references (<[id]>, <token>) are not supported",
    "!": "negated token references (!<token>) are not supported",
}


def gbnf_grammar(text: str, param: str) -> str:
    """A llama.cpp GBNF grammar, translated to Lark by llguidance's converter."""
    import llguidance
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    if not text.strip():
        raise InvalidRequest("the grammar is empty", param=param)
    try:
        lark = gbnf_to_lark(text)
    except GbnfToLarkError as error:
        construct = _UNTRANSLATED.get(error.pos.current())
        reason = f"{construct}: {error}" if construct else str(error)
        raise InvalidRequest(f"the GBNF grammar cannot be translated: {reason}", param=param) from None
    except Exception as error:  # the converter's own checks (unknown rule, no root) raise plain errors
        raise InvalidRequest(f"the GBNF grammar cannot be translated: {error}", param=param) from None
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def text_lark(text: str, specials: Mapping[str, int]) -> str:
    """Lark for literal text, with every marker that is one special token written ``<[id]>``."""
    out, rest = [], text
    while rest:
        at, marker = min(((rest.find(m), m) for m in specials if m in rest), default=(-1, ""))
        if at < 0:
            out.append(json.dumps(rest, ensure_ascii=False))
            break
        if at:
            out.append(json.dumps(rest[:at], ensure_ascii=False))
        out.append(f"<[{specials[marker]}]>")
        rest = rest[at + len(marker) :]
    return " ".join(out) if out else '""'


def structural_tag_grammar(
    text: str, param: str, specials: Mapping[str, int], whitespace: dict[str, Any]
) -> str:
    """vLLM's structural tag (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``)
    as Lark: free text; from a trigger on, one of the structures whose ``begin`` starts with it
    (the rest of ``begin``, JSON matching ``schema``, ``end``); then free text again, any number of
    times. A trigger that is one added token (``specials``) is matched as that token, others as text
    (a lazy lexeme: the first occurrence ends the free text). ``whitespace``: every schema's
    ``x-guidance`` options."""
    structures, triggers = _structural_tag(text, param)
    rules = [_FREE_TEXT]
    tags = []
    for t, trigger in enumerate(triggers):
        bodies = []
        for s, structure in enumerate(structures):
            if structure["trigger"] != trigger:
                continue
            schema = {**structure["schema"], "x-guidance": whitespace}
            rest, end = structure["begin"][len(trigger) :], structure["end"]
            head = f"{text_lark(rest, specials)} " if rest else ""
            tail = f" {text_lark(end, specials)}" if end else ""
            rules.append(f"s_{s}: {head}j_{s}{tail}")
            rules.append(f"j_{s}: %json {json.dumps(schema)}")
            bodies.append(f"s_{s}")
        if trigger in specials:
            rules.append(f"tag_{t}: TAG_TEXT <[{specials[trigger]}]> ({' | '.join(bodies)})")
        else:
            rules.append(f"trig_{t}[lazy]: TAG_TEXT {json.dumps(trigger, ensure_ascii=False)}")
            rules.append(f"tag_{t}: trig_{t} ({' | '.join(bodies)})")
        tags.append(f"tag_{t}")
    import llguidance

    lark = "%llguidance {}\n" + f"start: ({' | '.join(tags)})* TAG_TEXT\n" + "\n".join(rules) + "\n"
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def _structural_tag(text: str, param: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The structures (each with the longest trigger its ``begin`` starts with) and the triggers
    of a structural tag, checked: every structure begins with a trigger, every trigger starts one."""
    try:
        tag = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise InvalidRequest(f"the structural tag is not valid JSON: {error}", param=param) from None
    if not isinstance(tag, dict):
        raise InvalidRequest("the structural tag must be a JSON object", param=param)
    if "structures" not in tag and "format" in tag:
        raise InvalidRequest(
            "the structural tag's 'format' form is not supported; give 'structures' and 'triggers'",
            param=param,
        )
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise InvalidRequest("the structural tag needs 'structures', a non-empty list", param=param)
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidRequest(
            "the structural tag needs 'triggers', a non-empty list of non-empty strings", param=param
        )
    out = []
    for i, structure in enumerate(structures):
        where = f"structures[{i}]"
        if not isinstance(structure, dict):
            raise InvalidRequest(f"{where} must be an object with begin, schema and end", param=param)
        begin, end, schema = structure.get("begin"), structure.get("end", ""), structure.get("schema")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise InvalidRequest(f"{where}.begin and {where}.end must be strings", param=param)
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{where}.schema must be a JSON schema (an object)", param=param)
        trigger = max((t for t in triggers if begin.startswith(t)), key=len, default=None)
        if trigger is None:
            raise InvalidRequest(f"{where}.begin {begin!r} does not start with any trigger", param=param)
        out.append({"begin": begin, "end": end, "schema": schema, "trigger": trigger})
    unused = [t for t in triggers if not any(s["trigger"] == t for s in out)]
    if unused:
        raise InvalidRequest(f"the trigger {unused[0]!r} starts no structure's begin", param=param)
    return out, list(dict.fromkeys(triggers))
