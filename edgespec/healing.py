"""Token healing: a prompt that ends mid-word (what an editor's user has typed so far,
`    return sel`) ends in a token the model seldom saw there: ` sel` stands for itself, and the
model goes on as if the word were whole (`_hea` + `ppreplace`). Healing takes the last tokens
back and makes the answer begin with their bytes instead: its first tokens are only those whose
text extends what was taken back (` self`, ` select`) or begins it (` se`, then `l...`). The answer
then starts with the user's own characters, which are cut from the text it returns.

How far back (the "dynamic" rule of llama.cpp's token-healing PR #7187): the last token goes back
if a longer token begins with its text; each token before it too, while some token begins with
all the text taken back; never a special token, never past the text that may be healed (an
infill's middle), at most MAX_TOKENS tokens and MAX_BYTES bytes.

The law at a healed position is the target's law given the text: the request's sampling chain on
the logits of the allowed tokens alone (with temperature alone, p·1[allowed] renormalised), in a
verify row exactly as in a plain step, so that speculation stays exact; greedy, the likeliest
allowed token.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from .sampling import Law, SamplingParams, law
from .vocabulary import Vocabulary

MAX_TOKENS = 4  # tokens taken back at most
MAX_BYTES = 48  # ... and bytes


class Pieces:
    """A vocabulary's token texts in byte order: the tokens that begin with some bytes are a run of
    it, found by bisection. End-of-generation and special tokens (no text) never match."""

    def __init__(self, vocab) -> None:
        """vocab: piece(), is_eog() and n_vocab (a Model). Built once per model file (0.3 s for
        Qwen2.5's 151,936 tokens on a 2-core AMD EPYC)."""
        pieces = [b"" if vocab.is_eog(t) else vocab.piece(t) for t in range(vocab.n_vocab)]
        order = sorted(range(len(pieces)), key=pieces.__getitem__)
        self.sorted = [pieces[t] for t in order]
        self.ids = np.array(order, dtype=np.int64)

    def _run(self, prefix: bytes) -> tuple[int, int]:
        """Where the tokens that begin with `prefix` lie in self.sorted."""
        lo = bisect_left(self.sorted, prefix)
        above = _above(prefix)
        return lo, len(self.sorted) if above is None else bisect_left(self.sorted, above, lo)

    def begins(self, text: bytes) -> bool:
        """Whether some token's text begins with `text` (or is it)."""
        lo, hi = self._run(text)
        return lo < hi

    def extends(self, text: bytes) -> bool:
        """Whether some token's text begins with `text` and is longer."""
        lo, hi = self._run(text)
        return bisect_right(self.sorted, text, lo, hi) < hi

    def tokens_of(self, text: bytes) -> np.ndarray:
        """The tokens whose text is exactly `text`."""
        lo = bisect_left(self.sorted, text)
        return self.ids[lo : bisect_right(self.sorted, text, lo)]

    @lru_cache(maxsize=64)  # noqa: B019 (one Pieces per model file, kept for the process)
    def allowed(self, remaining: bytes) -> np.ndarray:
        """The tokens that may come next while the answer still owes `remaining` (ascending): those
        that begin with it, and those whose text is a beginning of it."""
        lo, hi = self._run(remaining)
        parts = [self.ids[lo:hi]] + [self.tokens_of(remaining[:i]) for i in range(1, len(remaining))]
        return np.unique(np.concatenate(parts))


def _above(prefix: bytes) -> bytes | None:
    """The least bytes above every bytes that begin with `prefix` (None: there are none)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else None


_pieces: dict[str, Pieces] = {}


def pieces_of(model) -> Pieces:
    """The model's Pieces, made on first use and kept for the process, per model file."""
    key = str(model.path)
    if key not in _pieces:
        _pieces[key] = Pieces(model)
    return _pieces[key]


@dataclass(frozen=True)
class Healed:
    """A prompt healed: its first `kept` tokens are read; the answer must begin with `removed`."""

    kept: int
    removed: bytes


def heal(tokens: list[int], start: int, pieces: Pieces, piece: Callable[[int], bytes]) -> Healed:
    """How much of `tokens` to take back (see the module docstring); only tokens at `start` or after
    may go, and at least one token stays."""
    removed, kept = b"", len(tokens)
    while kept > max(start, 1) and len(tokens) - kept < MAX_TOKENS:
        text = piece(tokens[kept - 1])
        candidate = text + removed
        if not text or len(candidate) > MAX_BYTES:
            break
        # the last token goes if a longer one begins with it; the ones before, while one begins with all of it
        if not (pieces.extends(candidate) if not removed else pieces.begins(candidate)):
            break
        removed, kept = candidate, kept - 1
    return Healed(kept, removed)


class Healing:
    """The constraint of a healed answer (the same protocol as grammar.Grammar): which tokens may
    come next while the answer owes the bytes taken back, the law there, and the walk along the
    answer's tokens (accept)."""

    def __init__(self, pieces: Pieces, remaining: bytes, piece: Callable[[int], bytes]) -> None:
        self.pieces, self.remaining, self.piece = pieces, remaining, piece

    @property
    def done(self) -> bool:
        """The answer has written all it owed: nothing is constrained from here."""
        return not self.remaining

    def clone(self) -> Healing:
        return Healing(self.pieces, self.remaining, self.piece)

    def allows(self, ids: np.ndarray) -> np.ndarray:
        if self.done:
            return np.ones(len(ids), dtype=bool)
        return np.isin(ids, self.pieces.allowed(self.remaining))

    def accept(self, token: int) -> None:
        """Walk past `token` (one the constraint allows)."""
        text = self.piece(token)
        self.remaining = self.remaining[len(text) :] if self.remaining.startswith(text) else b""

    def law(self, logits: np.ndarray, params: SamplingParams, vocab: Vocabulary | None = None) -> Law:
        """The sampling chain on the allowed tokens' logits alone (the infill sampler's end of turn,
        which the answer may not take yet, left out: where nothing else survives, the chain without it)."""
        if self.done:
            return law(logits, params, vocab)
        if params.greedy:
            return Law.point(self.argmax(logits))
        ids = self._allowed(len(logits))
        masked = np.full(len(logits), -np.inf, dtype=np.float32)
        masked[ids] = logits[ids]
        p = law(masked, params, vocab)
        if np.isin(p.ids, ids).all():
            return p
        return law(masked, replace(params, infill=False), vocab)

    def argmax(self, logits: np.ndarray) -> int:
        if self.done:
            return int(np.argmax(logits))
        ids = self._allowed(len(logits))
        return int(ids[np.argmax(logits[ids])])

    def _allowed(self, n_vocab: int) -> np.ndarray:
        ids = self.pieces.allowed(self.remaining)
        return ids[ids < n_vocab]  # (a draft model's vocabulary may be shorter)

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the constraint allows, one after another."""
        walk = self.clone()
        for n, token in enumerate(tokens):
            if not walk.allows(np.array([token]))[0]:
                return tokens[:n]
            walk.accept(token)
        return tokens

    def forced_text(self, max_chars: int = 0) -> str:
        """Nothing is drafted for it: the text owed is the prompt's own tokenization, which the model
        is healed of."""
        return ""

    def finished(self) -> bool:
        return False
