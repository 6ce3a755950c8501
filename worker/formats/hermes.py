"""Hermes (Qwen2.5, Qwen3 and Sluice's built-in tool prompt): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks after any content, or a bare JSON call when the answer starts with ``{``;
the JSON is scanned as it streams. Design notes: docs/worker.md."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable

from sluice.ids import new_tool_call_id
from worker.formats.base import CallPiece, ContentPiece, Piece, merge_pieces
from worker.formats.declaration import CallProbe, JsonCall, ToolFormat
from worker.formats.markers import split_at_marker

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def decode_json_string(body: str) -> str:
    """The value of a JSON string literal's body (between the quotes), leniently: model text may hold
    raw control characters, invalid escapes (``\\q``, a Windows path) or a cut ``\\u`` escape. Those are
    kept as written instead of raising."""
    try:
        return _valid_unicode(str(json.loads(f'"{body}"', strict=False)))
    except json.JSONDecodeError:
        pass
    out: list[str] = []
    i = 0
    while i < len(body):
        char = body[i]
        if char != "\\" or i + 1 >= len(body):
            out.append(char)
            i += 1
            continue
        code = body[i + 1]
        if code in _ESCAPES:
            out.append(_ESCAPES[code])
            i += 2
        elif code == "u" and _is_hex(body[i + 2 : i + 6]):
            out.append(chr(int(body[i + 2 : i + 6], 16)))
            i += 6
        else:
            out.append(char)  # an invalid or cut escape stays as written
            i += 1
    return _valid_unicode("".join(out))


def _valid_unicode(text: str) -> str:
    """Surrogate pairs written as two ``\\u`` escapes join; a lone surrogate (which no UTF-8 wire
    accepts) becomes U+FFFD."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _is_hex(text: str) -> bool:
    return len(text) == 4 and all(c in "0123456789abcdefABCDEF" for c in text)


class _CallScanner:
    """Scans one JSON object character by character, pulling out "name" and the arguments' text."""

    def __init__(self) -> None:
        self.raw = ""
        self.depth = 0
        self.started = False
        self.done = False
        self.failed = False
        self.name: str | None = None
        self.arguments_seen = False
        self._in_string = False
        self._escape = False
        self._string = ""
        self._key: str | None = None  # a depth-1 key whose value comes next
        self._pending_key: str | None = None  # a depth-1 string that may turn out to be a key
        self._value_key: str | None = None  # the depth-1 key whose value is being read
        self._value_depth = 0
        self._value_is_string = False
        self.argument_text = ""  # argument text read so far (raw JSON of the value)

    def feed(self, char: str) -> None:
        self.raw += char
        if self.done:
            return
        if not self.started:
            if char == "{":
                self.started, self.depth = True, 1
            elif not char.isspace():
                self.failed, self.done = True, True
            return
        reading_arguments = self._value_key in ARGUMENT_KEYS
        if reading_arguments:
            self.argument_text += char
        if self._in_string:
            self._read_string_char(char)
        elif char == '"':
            self._in_string, self._string = True, ""
            if self.depth == 1 and self._value_key is None:
                self._pending_key = None
            elif self._value_key is not None and self.depth == 1:
                self._value_is_string = True
        elif char == ":" and self.depth == 1 and self._pending_key is not None:
            self._key, self._pending_key = self._pending_key, None
        elif char in "{[":
            if self._key is not None and self.depth == 1:
                self._start_value(char)
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self._value_key is not None and self.depth == self._value_depth:
                self._end_value(closing=True)
            if self.depth == 0:
                self.done = True
        elif char == "," and self.depth == 1:
            if self._value_key is not None:
                self._end_value(closing=False)
            self._key = None
        elif not char.isspace() and self._key is not None and self.depth == 1:
            self._start_value(char)  # a number, true, false or null

    def _read_string_char(self, char: str) -> None:
        if self._escape:
            self._escape = False
            self._string += char
        elif char == "\\":
            self._escape = True
            self._string += char
        elif char == '"':
            self._in_string = False
            if self.depth == 1:
                if self._key is not None and self._value_key is None:
                    self._start_value('"')
                    self._end_string_value()
                elif self._value_key is None:
                    self._pending_key = decode_json_string(self._string)
        else:
            self._string += char

    def _start_value(self, first: str) -> None:
        self._value_key, self._key = self._key, None
        self._value_depth = self.depth
        if self._value_key in ARGUMENT_KEYS:
            self.arguments_seen = True
            if first == '"':
                self._value_is_string = True
            else:
                self.argument_text = first

    def _end_string_value(self) -> None:
        key, self._value_key = self._value_key, None
        if key == "name":
            self.name = decode_json_string(self._string)
        elif key in ARGUMENT_KEYS:
            # Arguments given as a JSON string: the call's arguments are its contents.
            self.argument_text = decode_json_string(self._string)

    def _end_value(self, closing: bool) -> None:
        if self._value_key in ARGUMENT_KEYS and not self._value_is_string and not closing:
            self.argument_text = self.argument_text[:-1]  # the "," that ended a scalar
        self._value_key = None


class _State(enum.Enum):
    TEXT = 0  # content, watching for <tool_call>
    BLOCK = 1  # inside <tool_call> ... </tool_call>
    AFTER_BLOCK_JSON = 2  # the block's JSON is complete; waiting for </tool_call>
    BARE = 3  # a bare JSON call


class ToolCallParser:
    """One per choice. ``push`` and ``finish`` return content and tool-call pieces in order."""

    def __init__(self, allow_bare_json: bool = True, id_factory: Callable[[], str] = new_tool_call_id):
        self._allow_bare = allow_bare_json
        self._new_id = id_factory
        self._state = _State.TEXT
        self._held = ""
        self._only_space_so_far = True
        self._scanner: _CallScanner | None = None
        self._sent_arguments = 0
        self._named = False
        self._after_calls_text = False
        self.calls = 0

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        buffer, self._held = self._held + text, ""
        while buffer:
            if self._state is _State.TEXT:
                buffer = self._text(buffer, out)
            elif self._state is _State.AFTER_BLOCK_JSON:
                _, found, rest = split_at_marker(buffer, CLOSE)
                if not found:
                    self._held = rest
                    break
                self._state, buffer = _State.TEXT, rest
            else:
                buffer = self._scan(buffer, out)
        return merge_pieces(out)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._state in (_State.BLOCK, _State.BARE) and self._scanner is not None:
            self._close_call(out)
        elif self._held and self._state is _State.TEXT and (self._held.strip() or not self.calls):
            out.append(ContentPiece(self._held))
        self._held = ""
        return merge_pieces(out)

    def _text(self, buffer: str, out: list[Piece]) -> str:
        if self._allow_bare and self._only_space_so_far:
            stripped = buffer.lstrip()
            if not stripped:
                self._held = buffer
                return ""
            if stripped.startswith("{"):
                self._open_call(_State.BARE)
                return stripped
        before, found, rest = split_at_marker(buffer, OPEN)
        if before.strip():
            self._only_space_so_far = False
        if self.calls and not before.strip() and not self._after_calls_text:
            # White space between or after calls is layout, not content: hold it until text follows.
            if not found:
                self._held = before + rest
                return ""
            before = ""
        elif self.calls:
            self._after_calls_text = True
        if before and (not self._only_space_so_far or not found):
            out.append(ContentPiece(before))
        if not found:
            self._held = rest
            return ""
        self._only_space_so_far = False
        self._open_call(_State.BLOCK)
        return rest

    def _open_call(self, state: _State) -> None:
        self._state, self._scanner = state, _CallScanner()
        self._sent_arguments, self._named = 0, False

    def _scan(self, buffer: str, out: list[Piece]) -> str:
        scanner = self._scanner
        assert scanner is not None  # set by _open_call
        for index, char in enumerate(buffer):
            scanner.feed(char)
            if scanner.failed:
                out.append(ContentPiece((OPEN if self._state is _State.BLOCK else "") + scanner.raw))
                rest = buffer[index + 1 :]
                self._state, self._scanner, self._only_space_so_far = _State.TEXT, None, False
                return rest
            if scanner.done:
                state, named = self._state, scanner.name is not None or self._named
                self._close_call(out)
                # A block that held a call waits for its closing tag; a nameless one was content.
                self._state = _State.AFTER_BLOCK_JSON if state is _State.BLOCK and named else _State.TEXT
                self._only_space_so_far = state is _State.BARE  # allow further bare calls
                return buffer[index + 1 :]
        self._stream(out)
        return ""

    def _stream(self, out: list[Piece]) -> None:
        scanner = self._scanner
        if scanner is None or scanner.name is None:
            return
        if not self._named:
            self._named = True
            out.append(CallPiece(self.calls, "", self._new_id(), scanner.name))
        if scanner.arguments_seen and not scanner._value_is_string:
            fresh = scanner.argument_text[self._sent_arguments :]
            if fresh:
                out.append(CallPiece(self.calls, fresh))
                self._sent_arguments += len(fresh)

    def _close_call(self, out: list[Piece]) -> None:
        scanner = self._scanner
        assert scanner is not None
        if scanner.name is None and not self._named:
            prefix = OPEN if self._state is _State.BLOCK else ""
            out.append(ContentPiece(prefix + scanner.raw))
        else:
            self._stream(out)
            final = scanner.argument_text if scanner.arguments_seen else "{}"
            if final.strip() == "" and scanner.arguments_seen:
                final = "{}"
            remaining = (
                final[self._sent_arguments :] if final.startswith(final[: self._sent_arguments]) else ""
            )
            if scanner._value_is_string or not scanner.arguments_seen:
                remaining = final
            if remaining:
                out.append(CallPiece(self.calls, remaining))
            self.calls += 1
        self._scanner = None


TOOL_FORMAT = ToolFormat(
    name="hermes",
    parser=ToolCallParser,
    grammar=JsonCall((OPEN, "\n"), ("\n", CLOSE), separator="\n"),
    # Qwen3-Coder's and GLM's calls open with <tool_call> too: theirs are tried first.
    probe=CallProbe((OPEN,), rank=1),
    markers=(OPEN, CLOSE),
)
