"""A suffix array over many token sequences: the longest match of a context's end, and what
followed it, at ten million tokens in well under a millisecond (pure numpy and bisect).

Why a suffix array: it is two flat int32 arrays (the tokens, and their positions in suffix
order), 8 bytes a token, saved and loaded as they are; a suffix automaton or tree in Python
would take hundreds of bytes a token. Lookups are binary searches (bisect over a memoryview,
the tokens compared as big-endian bytes, whose order is the token sequences' order). New
sequences are inserted suffix by suffix with the same search (about 10 µs a token), so the
index never needs to be rebuilt; removed ones are filtered out in one numpy pass.

Suffixes are ordered by their first DEPTH tokens only, up to their sequence's end (ties in
any order): patterns are never longer. Each sequence ends in SEPARATOR, which is no token, so
no match runs from one sequence into the next."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np

DEPTH = 32  # tokens a suffix is ordered by: the longest match looked for
SEPARATOR = 0xFFFFFFFF  # ends every sequence: above any token id, equal to none
TOKEN = np.dtype(">u4")  # big-endian: bytes compare as the token sequences do
STOP = SEPARATOR.to_bytes(4, "big")
SHORTER_TRIED = 8  # ends shorter than the longest found, looked at where its places are all excluded


@dataclass(frozen=True)
class Match:
    """The longest end of a context found: its `length` in tokens, and the positions (in the
    index's tokens) of what followed it, at `places` places in all (positions: a sample of them)."""

    length: int
    positions: np.ndarray
    places: int


class SuffixIndex:
    """Token sequences, each followed by SEPARATOR, and their suffixes in order."""

    def __init__(self, tokens: np.ndarray | None = None, order: np.ndarray | None = None) -> None:
        """tokens: sequences as laid out by an index before (see `tokens`), with its `order`."""
        self._bytes = bytearray(np.asarray(tokens if tokens is not None else [], dtype=TOKEN).tobytes())
        self.order = np.asarray(order if order is not None else [], dtype=np.int32)

    @property
    def tokens(self) -> np.ndarray:
        """All sequences, each ended by SEPARATOR (a copy)."""
        return np.frombuffer(bytes(self._bytes), dtype=TOKEN)

    def _view(self) -> np.ndarray:
        """The tokens without a copy: not to be kept (the bytes cannot grow while it lives)."""
        return np.frombuffer(self._bytes, dtype=TOKEN)

    def text(self, start: int, length: int) -> list[int]:
        """The `length` tokens from `start` on."""
        return np.frombuffer(self._bytes[4 * start : 4 * (start + length)], dtype=TOKEN).tolist()

    def ordered(self, sample: int) -> bool:
        """Whether `sample` evenly spread neighbours in the suffix order are in order (a file's check)."""
        step = max(1, (len(self.order) - 1) // sample)
        pairs = range(0, len(self.order) - 1, step)
        return all(self._key(int(self.order[i])) <= self._key(int(self.order[i + 1])) for i in pairs)

    def __len__(self) -> int:
        return len(self._bytes) // 4

    def _key(self, position: int) -> bytearray:
        """What a suffix is ordered by: its first DEPTH tokens, up to its separator (what follows
        that changes as sequences come and go). A token's first byte is 0 (ids are below 2^24), so
        four 0xFF bytes are a separator wherever they are found."""
        key = self._bytes[4 * position : 4 * (position + DEPTH)]
        end = key.find(STOP)
        return key[: end + 4] if end >= 0 else key

    def add(self, sequence: list[int]) -> int:
        """Append `sequence` (and its separator) and insert its suffixes; its start position."""
        start = len(self)
        self._bytes += np.asarray([*sequence, SEPARATOR], dtype=TOKEN).tobytes()
        order, keys = memoryview(self.order), self._key
        # where each new suffix goes among the old ones (the new ones among themselves: sorted after)
        new = list(range(start, start + len(sequence)))
        places = [bisect_left(order, keys(p), key=keys) for p in new]
        new.sort(key=keys)
        places.sort()
        self.order = np.insert(self.order, places, new).astype(np.int32)
        return start

    def remove(self, spans: list[tuple[int, int]]) -> np.ndarray:
        """Drop the tokens of the [start, end) spans (whole sequences with their separators);
        returns each old position's shift (old position p is now p - shift[p])."""
        keep = np.ones(len(self), dtype=bool)
        for start, end in spans:
            keep[start:end] = False
        shift = np.cumsum(~keep)
        self._bytes = bytearray(self._view()[keep].tobytes())
        kept = self.order[keep[self.order]]
        self.order = (kept - shift[kept]).astype(np.int32)
        return shift

    def interval(self, pattern: list[int]) -> tuple[int, int]:
        """The range of `order` whose suffixes begin with `pattern` (at most DEPTH tokens)."""
        key = np.asarray(pattern, dtype=TOKEN).tobytes()
        n = len(key)
        order = memoryview(self.order)

        def prefix(position: int) -> bytearray:
            return self._bytes[4 * position : 4 * position + n]

        lo = bisect_left(order, key, key=prefix)
        return lo, bisect_right(order, key, lo=lo, key=prefix)

    def longest(self, context: list[int], shortest: int, places: int, excluded=None) -> Match | None:
        """The longest end of `context` (shortest..DEPTH tokens) found here, with the positions of
        the token after it at up to `places` of its places (an even sample of more); excluded(p)
        tells positions not to use (a mask over them). None where not even `shortest` tokens are found."""
        if len(context) < shortest or not len(self.order):
            return None
        lo, hi = shortest, min(DEPTH, len(context))
        a, b = self.interval(context[-lo:])
        if a == b:
            return None
        while lo < hi:  # an end found means every shorter end is found: bisect the length
            mid = (lo + hi + 1) // 2
            a, b = self.interval(context[-mid:])
            lo, hi = (mid, hi) if b > a else (lo, mid - 1)
        # where every place of the longest is excluded, a few shorter ends are tried
        for length in range(lo, max(shortest, lo - SHORTER_TRIED) - 1, -1):
            a, b = self.interval(context[-length:])
            step = max(1, (b - a) // places)
            positions = self.order[a:b:step][:places].astype(np.int64) + length
            if excluded is not None:
                positions = positions[~excluded(positions - length)]
            if len(positions):
                return Match(length, positions, b - a)
        return None

    def following(self, positions: np.ndarray, n: int) -> list[tuple[int, ...]]:
        """The tokens from each position on, up to n of them, each cut at its sequence's end."""
        tokens = self._view()
        windows = np.minimum(positions[:, None] + np.arange(n), len(tokens) - 1)
        rows = tokens[windows].astype(np.int64)
        ends = np.where((rows == SEPARATOR).any(axis=1), (rows == SEPARATOR).argmax(axis=1), n)
        return [tuple(row[:end]) for row, end in zip(rows.tolist(), ends.tolist(), strict=True)]
