import random

import pytest

from worker.output.stop_strings import StopStringMatcher


def run(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = []
    for piece in pieces:
        text, matched = matcher.push(piece)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    out.append(matcher.flush())
    return "".join(out), None


def test_stop_spanning_deltas_is_caught_and_never_emitted():
    matcher = StopStringMatcher(["STOP"])
    emitted = []
    for piece in ["Hello S", "T", "O", "P and more"]:
        text, matched = matcher.push(piece)
        emitted.append(text)
        if matched:
            break
    assert "".join(emitted) == "Hello "
    assert matched == "STOP"
    assert all("S" not in e for e in emitted[1:])


def test_false_start_is_released():
    assert run(StopStringMatcher(["\n\n"]), ["a\n", "b", "c"]) == ("a\nbc", None)


def test_earliest_of_several_stops_wins():
    assert run(StopStringMatcher(["world", "lo"]), ["hello world"]) == ("hel", "lo")


@pytest.mark.parametrize("seed", range(30))
def test_any_split_gives_the_unsplit_result(seed: int):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab\n<>é") for _ in range(40))
    stops = ["<a>", "b\nb", "éé"]
    whole = run(StopStringMatcher(stops), [text])
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(StopStringMatcher(stops), pieces) == whole
    emitted, _matched = whole
    assert all(stop not in emitted for stop in stops)


def test_a_kept_stop_string_ends_the_text():
    # include_stop_str_in_output: the stop is shown (even split over deltas); others are still cut.
    assert run(StopStringMatcher(["STOP", "END"], kept=["STOP"]), ["Hello S", "TO", "P more"]) == (
        "Hello STOP",
        "STOP",
    )
    assert run(StopStringMatcher(["STOP", "END"], kept=["STOP"]), ["a END b"]) == ("a ", "END")
