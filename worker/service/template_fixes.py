"""Known defects of official chat templates, patched at load so prompts equal the family's reference
renderer (harmony's encoder for gpt-oss). Each fix is an exact substring of the released template;
a template without it (another version) is left as it is."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# tool parser -> (released text, fixed text, why)
FIXES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "openai": (
        (
            '" to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>"',
            '" to=assistant<|channel|>commentary<|message|>" + message.content + "<|end|>"',
            "harmony renders a tool's result as its text, not as a JSON string in quotes",
        ),
        (
            '(tool_call.content_type if tool_call.content_type is defined else "json")',
            '(tool_call.content_type if tool_call.content_type is defined else "<|constrain|>json")',
            "harmony marks a call's JSON arguments with <|constrain|>json, as the model writes them",
        ),
        (
            '{{- developer_message }}\n        {{- "\\n\\n" }}',
            '{{- developer_message }}\n        {%- if tools %}{{- "\\n\\n" }}{%- endif %}',
            "harmony ends the developer instructions without a blank line unless tools follow",
        ),
    ),
}


def fix_template(tool_parser: str, template: str) -> str:
    """``template`` with the known fixes for its family applied (each logged once)."""
    for old, new, why in FIXES.get(tool_parser, ()):
        if old in template:
            template = template.replace(old, new)
            log.info("chat template patched: %s", why)
    return template
