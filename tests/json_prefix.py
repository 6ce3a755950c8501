"""Whether a text is valid JSON cut short (a prefix some completion makes valid): the check for a
grammar-constrained answer that ran out of ``max_tokens``."""

from __future__ import annotations


class _Truncated(Exception):
    """The text ended inside a value: a valid prefix so far."""


class _Prefix:
    def __init__(self, text: str):
        self.text, self.at = text, 0

    def peek(self) -> str:
        if self.at >= len(self.text):
            raise _Truncated
        return self.text[self.at]

    def take(self, expected: str) -> None:
        for char in expected:
            if self.peek() != char:
                raise ValueError(f"expected {expected!r} at {self.at}")
            self.at += 1

    def spaces(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
            self.at += 1

    def value(self) -> None:
        char = self.peek()
        if char == "{":
            self.container("}", self.member)
        elif char == "[":
            self.container("]", self.value)
        elif char == '"':
            self.string()
        elif char in "-0123456789":
            self.number()
        else:
            self.take({"t": "true", "f": "false", "n": "null"}.get(char, "\0"))

    def container(self, close: str, item: object) -> None:
        self.at += 1
        self.spaces()
        if self.peek() == close:
            self.at += 1
            return
        while True:
            item()  # type: ignore[operator]
            self.spaces()
            if self.peek() == close:
                self.at += 1
                return
            self.take(",")
            self.spaces()

    def member(self) -> None:
        self.string()
        self.spaces()
        self.take(":")
        self.spaces()
        self.value()

    def string(self) -> None:
        self.take('"')
        while (char := self.peek()) != '"':
            if char < " ":
                raise ValueError(f"control character in a string at {self.at}")
            self.at += 1
            if char == "\\":
                escape = self.peek()
                self.at += 1
                if escape == "u":
                    for _ in range(4):
                        if self.peek() not in "0123456789abcdefABCDEF":
                            raise ValueError(f"bad \\u escape at {self.at}")
                        self.at += 1
                elif escape not in '"\\/bfnrt':
                    raise ValueError(f"bad escape at {self.at}")
        self.at += 1

    def number(self) -> None:
        if self.peek() == "-":
            self.at += 1
        self.digits(leading=True)
        if self.at < len(self.text) and self.text[self.at] == ".":
            self.at += 1
            self.digits()
        if self.at < len(self.text) and self.text[self.at] in "eE":
            self.at += 1
            if self.peek() in "+-":
                self.at += 1
            self.digits()

    def digits(self, *, leading: bool = False) -> None:
        if not self.peek().isdigit():
            raise ValueError(f"expected a digit at {self.at}")
        first = self.text[self.at]
        self.at += 1
        if leading and first == "0":
            return
        while self.at < len(self.text) and self.text[self.at].isdigit():
            self.at += 1


def is_json_prefix(text: str) -> bool:
    """True when ``text`` is one JSON value, possibly cut short (leading and trailing spaces allowed)."""
    scan = _Prefix(text)
    try:
        scan.spaces()
        scan.value()
        scan.spaces()
    except _Truncated:
        return True
    except ValueError:
        return False
    return scan.at == len(text)
