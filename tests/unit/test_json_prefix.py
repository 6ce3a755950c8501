"""The test helper that tells valid JSON cut short from text no completion makes valid."""

from __future__ import annotations

import json
import random

import pytest

from tests.json_prefix import is_json_prefix

VALID = [
    {"name": "Tom", "legs": 4, "weight": -3.5e2, "tags": ["a", "b\\n\u00e9"], "ok": True, "x": None},
    [1, [2, [3, {}]], '"quoted"', False, 0, 0.25],
    "text",
    12,
]


@pytest.mark.parametrize("value", VALID)
def test_every_cut_of_valid_json_is_a_prefix(value):
    for indent in (None, 2):
        text = json.dumps(value, indent=indent, ensure_ascii=bool(indent))
        assert all(is_json_prefix(text[:cut]) for cut in range(len(text) + 1))


@pytest.mark.parametrize(
    "text",
    [
        '{"a" 1}',
        '{"a": 1,}',
        "[1 2]",
        '{"a": tru e}',
        "01",
        '"\x01"',
        '{"a": 1} x',
        '"\\q"',
        "{'a': 1}",
        "-x",
    ],
)
def test_text_no_completion_can_fix_is_not_a_prefix(text):
    assert not is_json_prefix(text)


def test_random_edits_agree_with_json_loads_on_complete_texts():
    rng = random.Random(7)
    base = json.dumps(VALID[0])
    for _ in range(300):
        chars = list(base)
        chars[rng.randrange(len(chars))] = rng.choice('{}[]",:0a- ')
        text = "".join(chars)
        try:
            json.loads(text)
        except ValueError:
            continue
        assert is_json_prefix(text)
