"""What a model is asked to decode: a sequence's next tokens (Pass, a chain or a tree of drafts),
decoded beside other sequences' (Model.decode), or each alone (decoded_alone)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np


class Decoder(Protocol):
    """What decodes passes: a Model."""

    def decode(self, passes: list[Pass]) -> None: ...


@dataclass(frozen=True)
class TreePass:
    """A tree pass not yet settled (Cache.keep): its nodes from position `at` on."""

    at: int
    first: list[int]  # the branch of first children, which the current sequence holds
    spares: list[int]  # the other branches' sequence ids
    hidden: np.ndarray | None  # where they are exported: the hidden states of its root and nodes, in node order


@dataclass(eq=False)
class Pass:
    """A sequence's next tokens, decoded beside the other sequences' (Model.decode): then the
    logits of its last `rows` tokens (a view into llama.cpp's buffer, as eval's: valid until the
    model's next decode), or the error that stopped it. A pass of no tokens is a run waiting a
    step (for another to read the prompt they share, see Sequences.reading_ahead)."""

    seq: int
    tokens: list[int]
    rows: int | None = None  # None: the last token's row alone, shape (n_vocab,); else (rows, n_vocab)
    model: Decoder | None = None  # whose pass it is (the target's or the draft model's: Engine.decode)
    logits: np.ndarray | None = None
    error: Exception | None = None  # ContextFull, or a failed decode (EdgespecError)
    seconds: float = 0.0  # the decode it was part of
    beside: tuple[tuple[int, int], ...] = ()  # (seq, tokens) of the passes decoded with it
    # a tree of drafts after the tokens the cache lacks (Model.can_branch): the last len(parents)
    # tokens are its nodes, parents[i] node i's parent (-1: the token before the nodes); rows
    # then come for that token and every node; Cache.keep() settles which branch stays
    parents: list[int] | None = None

    def result(self) -> np.ndarray:
        """The logits, or the error raised."""
        if self.error is not None:
            raise self.error
        return self.logits


T = TypeVar("T")


def decoded_alone(steps: Generator[Pass, None, T]) -> T:
    """What a generator of passes returns, each pass decoded alone as it comes."""
    while True:
        try:
            one = next(steps)
        except StopIteration as end:
            return end.value
        one.model.decode([one])


class ContextFull(Exception):
    """The sequence no longer fits in the context window."""

    def __init__(self, n_ctx: int) -> None:
        super().__init__(f"context full ({n_ctx} tokens)")
        self.n_ctx = n_ctx
