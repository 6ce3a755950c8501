"""The one settings system of both services: a frozen dataclass whose fields are made with
:func:`setting`. Flags, ``<PREFIX>_<FLAG>`` environment variables, ``--help``, docs/configuration.md
and the deploy checks all derive from those fields (:func:`parse_settings`, :func:`describe`).
A boolean setting is a switch (``--name``, ``--no-name``, or ``--name on|off``); a ``testing=True``
one is a test double, listed apart (:data:`TESTING_GROUP`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

_SPEC = "sluice_setting"
ON_WORDS = frozenset({"1", "true", "yes", "on"})
OFF_WORDS = frozenset({"0", "false", "no", "off"})

T = TypeVar("T")


@dataclass(frozen=True)
class SettingSpec:
    """How a field is read: ``parse`` turns the raw text into the value or raises
    ``ValueError("must be ...")``; ``shown_default`` replaces a computed default in docs and help."""

    parse: Callable[[str], Any]
    help: str
    switch: bool = False
    shown_default: str | None = None
    flag: str | None = None  # the flag's name without ``--`` when it is not the field's name
    secret: bool = False  # never echo the value
    testing: bool = False  # a test double: listed apart from the production settings
    short: str | None = None  # a short flag besides the long one (``-tp``), as vLLM spells it


#: The ``--help`` group and docs/configuration.md section of the ``testing=True`` settings.
TESTING_GROUP = "testing and benchmarks only"


def setting(
    default: Any = dataclasses.MISSING,
    parse: Callable[[str], Any] | None = None,
    help: str = "",
    *,
    shown_default: str | None = None,
    flag: str | None = None,
    secret: bool = False,
    testing: bool = False,
    short: str | None = None,
) -> Any:
    """A dataclass field that is also a flag and a variable; a bool default makes it a switch.
    ``testing``: a test double, never for production (listed apart, see :data:`TESTING_GROUP`)."""
    switch = isinstance(default, bool)
    parser = on_off if switch else (parse or text)
    spec = SettingSpec(parser, help, switch, shown_default, flag, secret, testing, short)
    return dataclasses.field(default=default, repr=not secret, metadata={_SPEC: spec})


@dataclass(frozen=True)
class Setting:
    """One field seen as a setting of a service whose variables start with ``prefix``."""

    name: str
    default: Any
    spec: SettingSpec
    prefix: str
    type_name: str = ""  # the field's annotation, as text

    @property
    def flag(self) -> str:
        return "--" + (self.spec.flag or self.name.replace("_", "-"))

    @property
    def env(self) -> str:
        return self.prefix + self.flag[2:].upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.name


def settings_of(cls: type, prefix: str) -> list[Setting]:
    """The settings of a dataclass, in field (``--help``) order."""
    return [
        Setting(f.name, f.default, f.metadata[_SPEC], prefix, str(f.type))
        for f in dataclasses.fields(cls)
        if _SPEC in f.metadata
    ]


def describe(cls: type, prefix: str, *, testing: bool | None = None) -> list[tuple[str, str, object, str]]:
    """Every setting as ``(flag, env var, default, help)``: docs/configuration.md and deploy checks.
    A default computed from other settings is its description (a string). ``testing``: None for
    all, False for the production settings only, True for the test doubles only."""
    return [
        (s.flag, s.env, s.spec.shown_default or s.default, s.spec.help)
        for s in settings_of(cls, prefix)
        if testing is None or s.spec.testing == testing
    ]


def build_parser(cls: type, prefix: str, prog: str, description: str) -> argparse.ArgumentParser:
    """The ``--help``-bearing parser; every value is kept as raw text (None when not given)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{description} Every flag can also be set as {prefix}<FLAG> "
        f"(e.g. {prefix}PORT); flags win. A switch takes --name, --no-name or --name on|off.",
    )
    testing = parser.add_argument_group(
        TESTING_GROUP, "test doubles for the test suite and the benchmarks; never set them in production"
    )
    for item in settings_of(cls, prefix):
        group = testing if item.spec.testing else parser
        shown = item.spec.shown_default
        if shown is None and item.default not in (None, "", (), dataclasses.MISSING):
            shown = ("on" if item.default else "off") if item.spec.switch else str(item.default)
        suffix = f" (default: {shown})" if shown is not None else ""
        help_text = (item.spec.help + suffix).replace("%", "%%")  # argparse formats help with %
        if item.spec.switch:
            group.add_argument(
                item.flag, dest=item.dest, nargs="?", const="on", metavar="on|off", help=help_text
            )
            group.add_argument(
                "--no-" + item.flag[2:],
                dest=item.dest,
                action="store_const",
                const="off",
                help=argparse.SUPPRESS,
            )
        else:
            last_word = item.flag[2:].rsplit("-", 1)[-1].upper()
            metavar = "N" if item.type_name.startswith("int") and last_word != "PORT" else last_word
            names = [item.flag, *([item.spec.short] if item.spec.short else [])]
            group.add_argument(*names, dest=item.dest, default=None, metavar=metavar, help=help_text)
    return parser


def parse_settings(
    cls: type[T],
    prefix: str,
    argv: Sequence[str] | None,
    environ: Mapping[str, str],
    *,
    prog: str,
    description: str,
    combine: Callable[[dict[str, Any], Mapping[str, str]], dict[str, Any]] | None = None,
) -> T:
    """Reads flags, falling back to variables (an empty one is unset), and builds ``cls``.

    Exits with status 2 and one line naming the flag or variable a bad value came from. ``combine``
    may rework the parsed values first, given where each came from (raising ``ValueError`` with the
    whole message); the class
    may raise ``ValueError("field: reason")`` and offer ``problems()`` for combinations.
    """
    parser = build_parser(cls, prefix, prog, description)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for item in settings_of(cls, prefix):
        raw: str | None = getattr(args, item.dest)
        source = item.flag
        if raw is None and environ.get(item.env):
            raw, source = environ[item.env], item.env
        if raw is None:
            continue
        sources[item.name] = source
        try:
            values[item.name] = item.spec.parse(raw)
        except ValueError as error:
            parser.error(f"{source}: {error}")
    try:
        if combine is not None:
            values = combine(values, sources)
    except ValueError as error:
        parser.error(str(error))
    for item in settings_of(cls, prefix):
        if item.default is dataclasses.MISSING and item.name not in values:
            parser.error(f"{item.flag} (or {item.env}) is required: {item.spec.help}")
    flags = {item.name: item.flag for item in settings_of(cls, prefix)}
    try:
        built = cls(**values)
    except ValueError as error:
        name, _, reason = str(error).partition(": ")
        parser.error(f"{sources.get(name) or flags.get(name, name)}: {reason}")
    problems: Callable[[], list[str]] | None = getattr(built, "problems", None)
    for problem in problems() if problems is not None else []:
        parser.error(problem)
    return built


# -- value parsers: each takes the raw text and raises ValueError("must be ...") --------------


def text(raw: str) -> str:
    return raw


def optional_text(raw: str) -> str | None:
    return raw or None


def on_off(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ON_WORDS:
        return True
    if value in OFF_WORDS:
        return False
    raise ValueError(f"must be on/off (also true/false, yes/no, 1/0), got {raw!r}")


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"must be an integer, got {raw!r}") from None
        if value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ValueError(f"must be at most {maximum}, got {value}")
        return value

    return parse


def seconds(*, positive: bool = False) -> Callable[[str], float]:
    """A finite number of seconds, above 0 (``positive``) or at least 0."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"must be a number of seconds, got {raw!r}") from None
        low_ok = value > 0 if positive else value >= 0
        if not (low_ok and value < float("inf")):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(f"must be a finite number of seconds {bound}, got {raw!r}")
        return value

    return parse


def choice(*allowed: str, prefix: str | None = None) -> Callable[[str], str]:
    """One of ``allowed``, or (with ``prefix``) anything starting with it (``cuda:1``)."""

    def parse(raw: str) -> str:
        value = raw.strip()
        if value not in allowed and not (prefix and value.startswith(prefix)):
            raise ValueError(f"must be one of {', '.join(allowed)}; got {raw!r}")
        return value

    return parse


def comma_list(raw: str) -> tuple[str, ...]:
    """Comma-separated items; blanks between commas are ignored."""
    return tuple(part.strip() for part in raw.split(",") if part.strip())
