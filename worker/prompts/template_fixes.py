# ruff: noqa: RUF001 (DeepSeek's markers have full-width bars and U+2581)
"""Known defects of released chat templates, patched at load (before the probe) so prompts equal the
family's reference renderer (harmony's encoder for gpt-oss) or documented format (DeepSeek V3's). Each
fix is an exact substring of the released template; a template without it is left as it is."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# (released text, fixed text, why)
FIXES: tuple[tuple[str, str, str], ...] = (
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
    # DeepSeek V3: a call is rendered when the content is null, which transformers drops from the message.
    (
        "{%- if message['role'] == 'assistant' and message['content'] is none %}",
        "{%- if message['role'] == 'assistant' and message['content'] is not defined %}",
        "DeepSeek V3: calls rendered for a message without content (transformers drops a null content)",
    ),
    (
        "{%- if message['role'] == 'assistant' and message['content'] is not none %}",
        "{%- if message['role'] == 'assistant' and message['content'] is defined %}",
        "DeepSeek V3: an answer is a message with content",
    ),
    (
        "{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}",
        "{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}"
        "{%- for tool in message['tool_calls']%}",
        "DeepSeek V3: every message's calls open their own block (not only the conversation's first)",
    ),
    (
        "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}",
        "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}",
        "DeepSeek V3: the calls block is closed once after the last call (it was left open after one call)",
    ),
)


def fix_template(template: str) -> str:
    """``template`` with every known fix that applies (each logged)."""
    for old, new, why in FIXES:
        if old in template:
            template = template.replace(old, new)
            log.info("chat template patched: %s", why)
    return template
