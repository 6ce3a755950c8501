"""The one settings system (sluice/settings.py) on a small settings class of its own."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sluice.settings import (
    TESTING_GROUP,
    build_parser,
    describe,
    int_at_least,
    parse_settings,
    seconds,
    setting,
)


@dataclass(frozen=True)
class Example:
    name: str = setting(parse=str, help="required")
    count: int = setting(3, int_at_least(1), "how many")
    wait_s: float = setting(1.5, seconds(positive=True), "wait", flag="wait")
    fast: bool = setting(False, help="go fast")
    careful: bool = setting(True, help="be careful")
    token: str = setting("", str, "a secret", secret=True)
    slow_ms: float = setting(0.0, seconds(), "a test double", testing=True)

    def __post_init__(self) -> None:
        if self.token == "bad-token":
            raise ValueError("token: not accepted")

    def problems(self) -> list[str]:
        return ["--fast and --count 7 do not go together"] if self.fast and self.count == 7 else []


def parse(argv: list[str], env: dict[str, str] | None = None) -> Example:
    return parse_settings(Example, "EX_", argv, env or {}, prog="example", description="An example.")


@pytest.mark.parametrize(
    ("argv", "env", "fast", "careful"),
    [
        ([], {}, False, True),
        (["--fast"], {}, True, True),
        (["--fast", "off"], {}, False, True),
        (["--no-careful"], {}, False, False),
        (["--careful", "no"], {}, False, False),
        ([], {"EX_FAST": "TRUE", "EX_CAREFUL": "0"}, True, False),
        (["--no-fast"], {"EX_FAST": "on"}, False, True),  # the flag wins
        ([], {"EX_FAST": ""}, False, True),  # an empty variable is unset
    ],
)
def test_switches_as_people_type_them(argv, env, fast, careful):
    settings = parse(["--name", "x", *argv], env)
    assert (settings.fast, settings.careful) == (fast, careful)


def test_values_flags_win_and_flag_names_may_differ_from_fields():
    settings = parse(["--name", "x", "--wait", "2"], {"EX_COUNT": "5", "EX_WAIT": "9"})
    assert (settings.count, settings.wait_s) == (5, 2.0)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--name", "x", "--count", "0"], {}, "--count: must be at least 1, got 0"),
        (["--name", "x"], {"EX_COUNT": "many"}, "EX_COUNT: must be an integer, got 'many'"),
        (["--name", "x", "--fast", "maybe"], {}, "--fast: must be on/off"),
        (["--name", "x", "--wait", "0"], {}, "--wait: must be a finite number of seconds > 0"),
        (["--name", "x", "--token", "bad-token"], {}, "--token: not accepted"),
        (["--name", "x"], {"EX_TOKEN": "bad-token"}, "EX_TOKEN: not accepted"),
        (["--name", "x", "--fast", "--count", "7"], {}, "--fast and --count 7 do not go together"),
        ([], {}, "name"),
    ],
)
def test_a_bad_value_exits_2_naming_where_it_came_from(argv, env, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse(argv, env)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "bad-token" not in err


def test_the_table_describes_every_setting_and_hides_secrets_from_repr():
    rows = {flag: (env, default) for flag, env, default, _help in describe(Example, "EX_")}
    assert rows["--wait"] == ("EX_WAIT", 1.5) and rows["--fast"] == ("EX_FAST", False)
    assert list(rows) == ["--name", "--count", "--wait", "--fast", "--careful", "--token", "--slow-ms"]
    assert "hunter2" not in repr(parse(["--name", "x", "--token", "hunter2"]))


def test_test_doubles_are_listed_apart_and_still_parse():
    production = [flag for flag, *_ in describe(Example, "EX_", testing=False)]
    assert "--slow-ms" not in production and "--fast" in production
    assert [flag for flag, *_ in describe(Example, "EX_", testing=True)] == ["--slow-ms"]
    help_text = build_parser(Example, "EX_", "example", "An example.").format_help()
    main, _, group = help_text.partition(TESTING_GROUP + ":")
    assert "--slow-ms" in group and "--fast" in main and "--fast" not in group
    assert parse(["--name", "x", "--slow-ms", "2"]).slow_ms == 2.0
    assert parse(["--name", "x"], {"EX_SLOW_MS": "3"}).slow_ms == 3.0
