"""Stop strings end the output exactly where generation would, however the text is streamed."""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from lifeline.engine.stop import StopChecker


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Grow the text one character at a time, as generation does; stop at the first completion."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if s and text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[: end if include else end - len(s)], s
    return text, None


def stream(deltas: list[str], stop: list[str], include: bool = False) -> tuple[str, str | None]:
    checker = StopChecker(stop, include)
    emitted, stop_str = "", None
    final, _ = reference("".join(deltas), stop, include)
    for delta in deltas:
        result = checker.feed(delta)
        emitted += result.emit
        assert final.startswith(emitted), "emitted text was later taken back"
        if not include:
            assert not any(s in emitted for s in stop if s)
        if result.stopped:
            stop_str = result.stop_str
            break
    return emitted + checker.flush(), stop_str


def splits(text: str) -> list[list[str]]:
    """One-shot, one character at a time, and every cut into two deltas."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    return [[text], list(text), *cuts]


CASES = [
    ("Hello world. The end", ["."]),
    ("abcabcSTOPdef", ["STOP"]),
    ("STOP at start", ["STOP"]),
    ("no stop string here", ["zzz", "qq"]),
    ("xxabcxx", ["abc", "bc", "xa"]),
    ("the fox jumps", ["ox", "fox j", "jumps"]),
    ("aaab", ["aab", "ab"]),
    ("ends with a partial st", ["stop"]),
    ("<|im_end|> tail", ["<|im_end|>", "<|im"]),
    ("xabc", ["xabc", "ab"]),
    ("", ["a"]),
]


def test_streamed_output_equals_one_shot_at_every_split():
    for text, stop in CASES:
        for include in (False, True):
            expected = reference(text, stop, include)
            for deltas in splits(text):
                assert stream(deltas, stop, include) == expected, (text, stop, include, deltas)


def test_stop_string_and_everything_after_it_are_dropped():
    assert stream(["Hello", " world", ". Bye"], ["."]) == ("Hello world", ".")


def test_stop_at_very_start_emits_nothing():
    checker = StopChecker(["##"])
    result = checker.feed("## title")
    assert result.stopped and result.emit == "" and checker.flush() == ""


def test_include_stop_str_keeps_the_stop_string_only():
    assert stream(["answer: 4", "2 END", " trailing"], ["END"], True) == ("answer: 42 END", "END")


def test_earliest_completing_of_several_stop_strings_wins():
    assert stream(["one two three"], ["three", "two"]) == ("one ", "two")
    assert stream(["xabc"], ["xabc", "ab"]) == ("x", "ab")


def test_overlapping_stop_strings_prefer_the_longest_completing_together():
    assert stream(["say hello"], ["lo", "hello"]) == ("say ", "hello")
    assert stream(["say hello"], ["lo", "hello"], True) == ("say hello", "hello")


def test_partial_stop_string_is_held_then_released_when_generation_ends():
    checker = StopChecker(["</answer>"])
    first = checker.feed("42</ans")
    assert first.emit == "42" and first.held == 5 and not first.stopped
    assert checker.flush() == "</ans"


def test_partial_stop_string_that_diverges_is_emitted():
    checker = StopChecker(["STOP"])
    assert checker.feed("ST").emit == ""
    assert checker.feed("ART").emit == "START"


def test_nothing_is_emitted_after_a_stop():
    checker = StopChecker(["x"])
    assert checker.feed("ax").stopped
    assert checker.feed("more").emit == "" and checker.flush() == ""


def test_no_stop_strings_passes_text_through():
    checker = StopChecker([])
    assert checker.feed("anything").emit == "anything" and checker.flush() == ""


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc.", max_size=20),
    stop=st.lists(st.text(alphabet="abc.", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 20), max_size=6),
    include=st.booleans(),
)
def test_any_split_of_any_text_matches_reference(text, stop, cuts, include):
    points = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(points)]
    assert stream(deltas, stop, include) == reference(text, stop, include)


def brute_held(text: str, stop: list[str]) -> int:
    """Longest suffix of `text` that is a proper prefix of a stop string."""
    return max((n for n in range(1, len(text) + 1) for s in stop
                if len(s) > n and s.startswith(text[-n:])), default=0)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab.é", max_size=60),
    stop=st.lists(st.text(alphabet="ab.é", max_size=8), min_size=0, max_size=6),
    cuts=st.lists(st.integers(0, 60), max_size=12),
    include=st.booleans(),
)
def test_automaton_matches_brute_force_and_holds_only_stop_prefixes(text, stop, cuts, include):
    points = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(points)]
    assert stream(deltas, stop, include) == reference(text, stop, include)
    checker, seen = StopChecker(stop, include), ""
    for delta in deltas:
        seen += delta
        result = checker.feed(delta)
        if result.stopped:
            break
        assert result.held == (0 if include else brute_held(seen, [s for s in stop if s]))


def transitions_for(stop_length: int, text: str, deltas: int) -> int:
    checker = StopChecker(["a" * stop_length + "b", "x" * stop_length])
    step = len(text) // deltas
    for i in range(0, len(text), step):
        assert not checker.feed(text[i : i + step]).stopped
    return checker.transitions


def test_cost_per_character_does_not_grow_with_stop_length():
    """The worst case of the old tail re-scan: text that keeps matching a long stop string's
    prefix. The automaton makes at most two moves a character, for a short or a long stop."""
    text = "a" * 20_000 + "c" + "xa" * 5_000
    short, long = transitions_for(10, text, 2_000), transitions_for(100_000, text, 2_000)
    assert short <= 2 * len(text) and long <= 2 * len(text)


def test_long_stop_string_held_then_released_or_matched():
    stop = "z" * 50_000
    checker = StopChecker([stop])
    emitted = checker.feed("head").emit
    for _ in range(49_999):
        emitted += checker.feed("z").emit
    assert emitted == "head" and checker.held == 49_999
    assert checker.feed("z").stop_str == stop
    checker = StopChecker([stop])
    checker.feed("z" * 49_999)
    assert checker.feed("!").emit == "z" * 49_999 + "!"


def test_a_stop_string_inside_a_longer_ones_prefix_is_found_whatever_order_they_come_in():
    """'.ba' (a prefix of '.bab') fails over to 'ba' (of 'bab', a later stop string) whose
    own failure is the stop string 'a': the match must be found although 'ba' was built after
    '.ba' (found by the property test below)."""
    stop = ["a", ".bab", "bab", "é.a."]
    assert stream([".é.baa", "aé"], stop) == reference(".é.baaaé", stop, False) == (".é.b", "a")
