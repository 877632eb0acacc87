"""Stop strings cut streamed text before the first of them, wherever the chunks split it."""

from __future__ import annotations

import pytest

from kvswitch.router.stop_strings import StopStrings


def run(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    cutter = StopStrings(stops)
    pieces = [cutter.push(chunk) for chunk in chunks]
    return [*pieces, cutter.flush()], cutter.stopped


def test_a_stop_string_split_over_chunks_is_held_back_then_cut() -> None:
    assert run(["END"], ["abc E", "N", "Dxyz"]) == (["abc ", "", "", ""], True)


def test_a_held_tail_that_turns_out_not_to_stop_is_sent() -> None:
    assert run(["END"], ["abc E", "Nd"]) == (["abc ", "ENd", ""], False)
    assert run(["END"], ["abc EN"]) == (["abc ", "EN"], False)  # the flush hands it over


def test_the_earliest_of_several_stop_strings_wins() -> None:
    assert run(["world", "lo w"], ["hello world"]) == (["hel", ""], True)


def test_nothing_is_sent_after_the_stop() -> None:
    assert run(["\n"], ["a\nb", "c"]) == (["a", "", ""], True)


@pytest.mark.parametrize("text", ["one two. three", "..", "no stop here", "ab.c.d"])
def test_any_split_gives_the_text_cut_at_the_first_stop(text: str) -> None:
    stops = [". ", ".."]
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(found)] if found else text
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces, stopped = run(stops, [text[:i], text[i:j], text[j:]])
            assert "".join(pieces) == expected
            assert stopped == bool(found)


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStrings(["x", ""])
