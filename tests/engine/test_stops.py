"""Stop sequences: split across deltas, overlapping, several at once, at the very start; nothing after a stop."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine import stops as stops_mod
from service.engine.stops import StopMatcher
from service.errors import InvalidRequest


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool, StopMatcher]:
    m = StopMatcher(stops)
    out = []
    stopped = False
    for d in deltas:
        text, stopped = m.push(d)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped, m


def _oracle(stops: list[str], text: str) -> tuple[str, bool]:
    """Feed the text one character at a time to a brute-force search: stop at the first completed stop."""
    for end in range(1, len(text) + 1):
        hits = [(end - len(s)) for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: min(hits)], True
    return text, False


def test_stop_split_across_deltas() -> None:
    out, stopped, m = _run(["<|user|>"], ["Hello <|", "us", "er|> never", " this"])
    assert (out, stopped, m.matched) == ("Hello ", True, "<|user|>")


def test_holds_back_only_what_could_still_be_a_stop() -> None:
    m = StopMatcher(["###"])
    assert m.push("ab#") == ("ab", False)
    assert m.held == "#"
    assert m.push("#x") == ("##x", False)  # '##x' cannot start '###'
    assert m.push("##") == ("", False)
    assert m.push("#tail") == ("", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_stop_at_the_very_start() -> None:
    assert _run(["STOP"], ["STOP and more"])[:2] == ("", True)
    assert _run(["STOP"], ["S", "T", "O", "P"])[:2] == ("", True)


def test_overlapping_stops() -> None:
    # "aab" overlaps itself: the matcher must not drop the second 'a' when "aaa" breaks the first attempt.
    assert _run(["aab"], ["a", "a", "a", "b", "c"])[:2] == ("a", True)
    # Two stops where one is inside the other: the shorter completes first.
    out, stopped, m = _run(["abcd", "bc"], ["abcd"])
    assert (out, stopped, m.matched) == ("a", True, "bc")
    # One is a prefix of the other: the shorter one completes first.
    out, _, m = _run(["end", "ending"], ["the ending"])
    assert (out, m.matched) == ("the ", "end")


def test_multiple_stops_earliest_wins() -> None:
    out, stopped, m = _run(["\n\n", "User:", "</s>"], ["Sure.", " User", ": hi\n\nmore</s>"])
    assert (out, stopped, m.matched) == ("Sure. ", True, "User:")


def test_no_stop_releases_everything_on_flush() -> None:
    out, stopped, _ = _run(["<end>"], ["a <en", "d and <e", "n"])
    assert (out, stopped) == ("a <end and <en", False)
    assert _run([], ["anything", " goes"])[:2] == ("anything goes", False)


def test_unicode_stops() -> None:
    assert _run(["😀!"], ["hi 😀", "😀", "!", "x"])[:2] == ("hi 😀", True)


def test_empty_stop_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        StopMatcher(["ok", ""])


def test_random_streams_match_a_brute_force_oracle() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randrange(0, 25)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(0, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        m = StopMatcher(stops)
        emitted = ""
        stopped = False
        for d in deltas:
            piece, stopped = m.push(d)
            emitted += piece
            # Never emit anything that a later delta could turn into (part of) a stop.
            assert text.startswith(emitted)
            if stopped:
                break
        if not stopped:
            emitted += m.flush()
        expected, exp_stopped = _oracle(stops, text)
        assert (emitted, stopped) == (expected, exp_stopped), (stops, deltas)
        assert not any(s in emitted for s in stops)


def _peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("n", [20_000, 200_000])
def test_a_long_stop_costs_memory_linear_in_its_length(n: int) -> None:
    # Keeping every prefix of a stop (the old matcher) needs n**2 / 2 characters: 200 MB for n = 20k.
    stop = "".join(chr(0x61 + (i * 7919) % 26) for i in range(n))
    text = stop[: n // 2] + "#" + stop  # a long near miss, then the stop itself

    def run() -> None:
        out, stopped, m = _run([stop], [text[i : i + 7] for i in range(0, len(text), 7)])
        assert (out, stopped, m.matched) == (stop[: n // 2] + "#", True, stop)

    assert _peak_bytes(run) < 40 * n + (1 << 20)


def test_many_distinct_long_stops_stay_small() -> None:
    # The case: 30 distinct 10,000-character stops (hundreds of MB with one string per prefix).
    stops = [f"{i:02d}" + "x" * 9_998 for i in range(30)]
    text = "y" * 100 + "x" * 20_000 + stops[17][:5_000] + "zz" + stops[29] + "tail"

    def run() -> None:
        out, stopped, m = _run(stops, [text[i : i + 3] for i in range(0, len(text), 3)])
        assert (stopped, m.matched) == (True, stops[29])
        assert out == text[: text.index(stops[29])]

    assert _peak_bytes(run) < 40 * sum(map(len, stops)) + (1 << 20)


def test_holding_a_long_tail_does_not_recopy_it_per_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    # 200k characters of a stop's prefix arrive one at a time: each push must copy O(delta), not O(held).
    copied = [0]  # characters the held buffer hands out (each one a copy)
    for name in ("take", "value"):
        real = getattr(stops_mod._Buffer, name)

        def counted(self: Any, *args: Any, _real: Any = real) -> str:
            out: str = _real(self, *args)
            copied[0] += len(out)
            return out

        monkeypatch.setattr(stops_mod._Buffer, name, counted)
    stop = "ab" * 100_000 + "!"
    m = StopMatcher([stop])
    for ch in stop[:-1]:
        assert m.push(ch) == ("", False)
    assert copied[0] == 0  # nothing released, nothing copied
    assert len(m.held) == len(stop) - 1
    assert m.push("?") == (stop[:-1] + "?", False)
    assert copied[0] <= 3 * len(stop)  # linear in the stream (held read once, released once); quadratic: 10^10


_ALPHABET = "ab😀"
_stops = st.lists(st.text(_ALPHABET, min_size=1, max_size=6), min_size=1, max_size=5)


@settings(max_examples=400, deadline=None)
@given(stops=_stops, text=st.text(_ALPHABET + "c", max_size=40), data=st.data())
def test_delta_cuts_never_change_the_result(stops: list[str], text: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    by_char = _run(stops, list(text))
    got = _run(stops, deltas)
    assert got[:2] == by_char[:2] == _oracle(stops, text)
    assert got[2].matched == by_char[2].matched
