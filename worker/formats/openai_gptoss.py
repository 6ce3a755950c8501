"""gpt-oss's harmony format: messages ``<|channel|>NAME<|message|>BODY<|end|>``, chained with
``<|start|>assistant``. ``analysis`` is reasoning, ``final`` the answer, and a message ``to=functions.X``
a call: the channel stage passes it on whole for the ``openai`` tool-call format (openai.py) to read."""

from __future__ import annotations

import enum
import re

from worker.formats.declaration import ReasoningFormat
from worker.formats.markers import split_at_first

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
CALL = "<|call|>"
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


class _State(enum.Enum):
    HEADER = 0  # reading a message's header, up to <|message|>
    BODY = 1
    PLAIN = 2  # the text is not harmony: all content


class HarmonyChannels:
    """The reasoning stage for harmony: (kind, text) pieces like ``ReasoningParser``'s."""

    def __init__(self) -> None:
        self._state = _State.HEADER
        self._held = ""
        self._header = ""
        self._body = ""  # a call's body, held until its message ends
        self._seen_text = False

    @property
    def in_thinking(self) -> bool:
        return self._state is _State.BODY and self._channel() == "analysis"

    def _channel(self) -> str:
        after = self._header.split(CHANNEL, 1)[-1]
        return after.split()[0] if after.split() else ""

    def _is_call(self) -> bool:
        return RECIPIENT.search(self._header) is not None

    def push(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        buffer, self._held = self._held + text, ""
        while buffer:
            if self._state is _State.PLAIN:
                out.append(("content", buffer))
                break
            if self._state is _State.HEADER:
                header = self._header + buffer
                if not self._seen_text and header.strip() and not _could_be_header(header):
                    self._state, buffer = _State.PLAIN, header
                    continue
                before, found, rest = header.partition(MESSAGE)
                if not found:
                    self._header = header
                    break
                self._seen_text = True
                self._header, self._state, buffer = before, _State.BODY, rest
                continue
            before, marker, rest = split_at_first(buffer, ENDS)
            if self._is_call():
                self._body += before
            else:
                out.append(("reasoning" if self.in_thinking else "content", before))
            if marker is None:
                self._held = rest
                break
            self._end_message(out)
            buffer = rest
        return [(kind, text) for kind, text in out if text]

    def _end_message(self, out: list[tuple[str, str]]) -> None:
        if self._is_call():
            header = self._header.replace(START, "").replace(CHANNEL, " ").strip()
            out.append(("content", f"{CHANNEL}{header}{MESSAGE}{self._body}{CALL}"))
        self._header, self._body, self._state = "", "", _State.HEADER

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        held, self._held = self._held, ""
        if self._state is _State.BODY:
            if self._is_call():
                self._body += held
                self._end_message(out)
            elif held:
                out.append(("reasoning" if self.in_thinking else "content", held))
        elif self._state is _State.PLAIN and held:
            out.append(("content", held))
        elif self._state is _State.HEADER and self._header.strip() and not self._seen_text:
            out.append(("content", self._header))
        return out


def _could_be_header(text: str) -> bool:
    """Whether text so far can still open a harmony message (a header starts with a marker)."""
    stripped = text.lstrip()
    return any(stripped.startswith(m) or m.startswith(stripped) for m in (START, CHANNEL))


REASONING_FORMAT = ReasoningFormat(
    name="openai_gptoss",
    stage=lambda starts_thinking: HarmonyChannels(),
    open_marker="",  # a prompt never opens a channel's message for the model
    shown=lambda model_type, template, vocab: CHANNEL in template and CHANNEL in vocab,
    rank=0,
    markers=(CHANNEL, MESSAGE),
    stop_tokens=(CALL,),
    # An analysis message, ended (a budget spent) by closing it and opening the final answer.
    block=(f"{CHANNEL}analysis{MESSAGE}", f"<|end|>{START}assistant{CHANNEL}final{MESSAGE}"),
)
