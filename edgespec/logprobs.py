"""Log-probabilities of tokens, as OpenAI's `logprobs` report them: the model's own
log-softmax over the vocabulary, before temperature and filters (OpenAI's and vLLM's
default), read from the target's rows (a verify pass has one for every drafted position, so
speculation changes none of them, and a draft's own law is never reported)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import EdgespecError

MAX_TOP = 20  # alternatives per token at most (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability under the target, and the likeliest tokens at its place
    (`top`, most likely first; their own `top` empty). A prompt's first token has none (None)."""

    token: int
    piece: bytes  # the token's text as the model writes it (possibly part of a UTF-8 character)
    logprob: float | None
    top: tuple[TokenLogprob, ...] = ()

    @property
    def text(self) -> str:
        return self.piece.decode("utf-8", "replace")

    def as_dict(self) -> dict:
        """The JSON view (the command line's --json): token id, text, log-probability, alternatives."""
        entry = {"token": self.token, "text": self.text, "logprob": self.logprob}
        return entry | ({"top": [t.as_dict() for t in self.top]} if self.top else {})


def top_count(top: int | None, name: str = "logprobs") -> int | None:
    """A number of alternatives per token (the field `name`), checked; None: no log-probabilities."""
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP):
        raise EdgespecError(f"'{name}' (alternatives per token) must be 0..{MAX_TOP}, got {top!r}")
    return top


def log_softmax(row: np.ndarray) -> np.ndarray:
    """log p over the vocabulary, in float64: z - max - log(sum(exp(z - max)))."""
    shifted = np.asarray(row, dtype=np.float64) - float(np.max(row))
    return shifted - np.log(np.exp(shifted).sum())


def token_logprobs(rows: np.ndarray, tokens: list[int], top: int, piece) -> list[TokenLogprob]:
    """Each of `tokens` scored by the row before it (rows[i] is the target's distribution
    of tokens[i]), with its `top` likeliest alternatives; piece(token) -> bytes."""
    out = []
    for logits, token in zip(np.atleast_2d(rows)[: len(tokens)], tokens, strict=True):
        row = log_softmax(logits)
        best = np.argpartition(-row, top - 1)[:top] if top else np.empty(0, dtype=np.int64)
        best = best[np.lexsort((best, -row[best]))]  # likeliest first, ties by id
        alternatives = tuple(TokenLogprob(int(t), piece(int(t)), float(row[t])) for t in best)
        out.append(TokenLogprob(token, piece(token), float(row[token]), alternatives))
    return out
