"""Stop strings are held back until they cannot match; split UTF-8 characters are held until complete."""

from __future__ import annotations

from modules.generation.stopping import StopMatcher, Utf8Stream


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    matcher = StopMatcher(stops)
    shown = []
    stopped = False
    for piece in pieces:
        out, stopped = matcher.feed(piece)
        shown.append(out)
        if stopped:
            break
    tail = matcher.flush()
    return shown, stopped, tail


def test_stop_string_split_across_tokens_is_never_shown() -> None:
    shown, stopped, tail = run(["\nUser:"], ["Hello", " there", "\n", "Us", "er", ":", " more"])
    assert stopped
    assert "".join(shown) + tail == "Hello there"
    assert shown == ["Hello", " there", "", "", "", ""]


def test_partial_match_is_released_when_it_diverges() -> None:
    shown, stopped, tail = run(["###"], ["a#", "#b", "c"])
    assert not stopped
    assert shown == ["a", "##b", "c"]
    assert tail == ""


def test_held_back_tail_is_released_at_the_end() -> None:
    shown, stopped, tail = run(["</s>"], ["ok </", "s"])
    assert not stopped
    assert "".join(shown) == "ok " and tail == "</s"


def test_earliest_of_several_stop_strings_wins() -> None:
    shown, stopped, _ = run(["world", "lo w"], ["hello world"])
    assert stopped and "".join(shown) == "hel"


def test_no_stop_strings_passes_everything_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("abc") == ("abc", False)


def test_utf8_character_split_across_tokens() -> None:
    stream = Utf8Stream()
    data = "é€😀".encode()
    out = [stream.feed(data[i : i + 1]) for i in range(len(data))]
    assert "".join(out) == "é€😀"
    assert out[0] == ""  # half of 'é' is held back
    assert stream.flush() == ""


def test_incomplete_utf8_at_the_end_becomes_replacement_character() -> None:
    stream = Utf8Stream()
    assert stream.feed(b"a" + "€".encode()[:2]) == "a"
    assert stream.flush() == "\ufffd"
