"""Formats whose calls are a JSON list after a marker: Granite ``<|tool_call|>[{...}]`` and
Phi-4-mini ``functools[{...}]``."""

from __future__ import annotations

from worker.output.formats.base import CallSyntax, json_call_list

GRANITE = CallSyntax(start="<|tool_call|>", parse=json_call_list)
PHI4_MINI = CallSyntax(start="functools", parse=json_call_list)
