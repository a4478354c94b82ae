"""Stop strings over streamed text: never leak one, not even a part that completes later."""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class StopResult:
    emit: str
    """Text the client may see now; never taken back."""
    stop_str: str | None = None
    """The stop string that ended generation, if one did."""
    held: int = 0
    """Characters kept back because they may be the start of a stop string."""

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None


class _Automaton:
    """Aho–Corasick over the stop strings. A state is a trie node: the longest suffix of the text
    read so far that is a prefix of a stop string, spelled `stop[pattern[n]][:depth[n]]`. The
    trie's edges live in one dict keyed by `node << 21 | ord(char)`, which is lighter than a dict
    per node for long stop strings."""

    __slots__ = ("goto", "fail", "depth", "pattern", "out")

    def __init__(self, stop: Sequence[str]) -> None:
        self.goto: dict[int, int] = {}
        self.depth, self.pattern, self.out = array("q", [0]), array("q", [0]), array("q", [-1])
        edges: list[tuple[int, int]] = [(0, 0)]
        for index, s in enumerate(stop):
            node = 0
            for c in s:
                key = node << 21 | ord(c)
                nxt = self.goto.get(key)
                if nxt is None:
                    nxt = self.goto[key] = len(self.depth)
                    self.depth.append(self.depth[node] + 1)
                    self.pattern.append(index)
                    self.out.append(-1)
                    edges.append((node, ord(c)))
                node = nxt
            if self.out[node] < 0:
                self.out[node] = index
        self.fail = array("q", bytes(8 * len(self.depth)))
        self._link(edges)

    def _link(self, edges: list[tuple[int, int]]) -> None:
        """Failure links, shallow nodes first; `out` becomes the longest stop string that is a
        suffix of the node's text (its own if it is one, else its failure node's)."""
        by_depth: list[list[int]] = [[] for _ in range(max(self.depth) + 1)]
        for node in range(1, len(self.depth)):
            by_depth[self.depth[node]].append(node)
        for level in by_depth[2:]:
            for node in level:
                parent, c = edges[node]
                f = self.fail[parent]
                while f and (f << 21 | c) not in self.goto:
                    f = self.fail[f]
                self.fail[node] = self.goto.get(f << 21 | c, 0)
        for level in by_depth[1:]:  # a failure node is shallower: its `out` is final by now
            for node in level:
                if self.out[node] < 0:
                    self.out[node] = self.out[self.fail[node]]

    def step(self, state: int, c: str) -> tuple[int, int]:
        """The state after reading `c`, and the moves it took (one, plus one per failure link)."""
        code, moves = ord(c), 1
        while state and (state << 21 | code) not in self.goto:
            state = self.fail[state]
            moves += 1
        return self.goto.get(state << 21 | code, 0), moves


class StopChecker:
    """Feed it the text deltas of one request; it says what to emit and when a stop string ends it.

    The stop is the first stop string to complete (the one generation would see first; among those
    completing at the same character, the longest). Without `include_stop_str_in_output` the output
    ends just before it, with it just after; nothing after it is ever emitted (OpenAI semantics).
    Whatever the split into deltas, the concatenated emits (plus `flush()` when generation ends for
    another reason) equal `feed(full_text).emit + flush()` on a fresh checker.

    The automaton is built once; its state carries over from one delta to the next, so a delta
    costs time linear in its length (amortised), whatever the number and length of the stop
    strings. `transitions` counts the automaton moves made, so that cost can be checked.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._ac = _Automaton(self.stop)
        self._state = 0
        self.held = 0  # trailing characters of the state's text not emitted yet
        self.stopped = False
        self.transitions = 0

    def feed(self, delta: str) -> StopResult:
        if self.stopped:
            return StopResult("")
        old_state, old_held = self._state, self.held
        for i, c in enumerate(delta):
            self._advance(c)
            found = self._ac.out[self._state]
            if found >= 0:
                s = self.stop[found]
                end = old_held + i + 1
                end = end if self.include_stop_str_in_output else max(0, end - len(s))
                self.held, self.stopped = 0, True
                return StopResult(self._unemitted(old_state, old_held, delta, end), s)
        held = 0 if self.include_stop_str_in_output else self._ac.depth[self._state]
        self.held = min(held, old_held + len(delta))
        emit = self._unemitted(old_state, old_held, delta, old_held + len(delta) - self.held)
        return StopResult(emit, held=self.held)

    def flush(self) -> str:
        """The held-back text, released because generation ended for another reason."""
        text = self._unemitted(self._state, self.held, "", self.held)
        self.held = 0
        return text

    def _advance(self, c: str) -> None:
        self._state, moves = self._ac.step(self._state, c)
        self.transitions += moves

    def _unemitted(self, state: int, held: int, delta: str, n: int) -> str:
        """The first `n` characters of the text not emitted yet: the last `held` characters of
        `state`'s text, then `delta`. Costs O(n), never the length of the stop string."""
        depth = self._ac.depth[state]
        spelled = self.stop[self._ac.pattern[state]] if depth else ""
        start = depth - held
        if n <= held:
            return spelled[start : start + n]
        return spelled[start:depth] + delta[: n - held]
