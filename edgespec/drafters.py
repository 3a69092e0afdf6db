"""Drafters: each proposes the next few tokens; the engine verifies them.

Like llama.cpp's common/speculative.cpp, making a draft is split from verifying
it: the engine does not care where a draft came from, only that q (if given)
is the distribution each token was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .model import Model
from .sampling import SamplingParams, distribution, sample


@dataclass
class Draft:
    tokens: list[int]
    # (len(tokens), V) distributions the tokens were sampled from; None means each
    # token is a point mass (deterministic drafts, and every greedy draft)
    q: np.ndarray | None = None
    source: str = "model"  # which kind of drafter made it: acceptance is tracked per source


class Drafter(Protocol):
    def prefill(self, context: list[int]) -> None:
        """Optionally get ready for drafts after `context` (timed as prefill)."""

    def draft(
        self,
        context: list[int],
        n: int,
        params: SamplingParams,
        rng: np.random.Generator,
        stop_below: Sequence[float] = (),
    ) -> Draft:
        """Propose up to n tokens to follow `context`. A drafter that knows its
        confidence stops before token i once the product of its confidences in
        tokens 0..i falls below stop_below[i] (a hint; others may ignore it)."""


class ModelDrafter:
    """Drafts with a small model sharing the target's tokenizer."""

    def __init__(self, model: Model, target_vocab: int) -> None:
        self.model = model
        self.target_vocab = target_vocab  # q rows are padded to the target's vocabulary size

    def prefill(self, context: list[int]) -> None:
        kept = self.model.sync(context)
        self.model.eval(context[kept:-1])

    def draft(self, context, n, params, rng, stop_below=()) -> Draft:
        model = self.model
        # the cache may hold rejected drafts from the last round: keep only the agreed prefix
        kept = model.sync(context)
        logits = model.eval(context[kept:])
        tokens: list[int] = []
        q_rows = None if params.greedy else np.zeros((n, self.target_vocab))  # padded to the target's vocab
        p_all = 1.0  # the draft's own estimate that every token so far is accepted
        while True:
            if params.greedy:
                token = int(np.argmax(logits))
                confidence = 1.0 / np.exp(logits - logits[token]).sum() if stop_below else 1.0
            else:
                q = q_rows[len(tokens)]
                q[: model.n_vocab] = distribution(logits, params)[: self.target_vocab]
                q /= q.sum()
                token = sample(q, rng)
                confidence = q[token]
            p_all *= confidence
            if len(tokens) < len(stop_below) and p_all < stop_below[len(tokens)]:
                break  # not worth verifying: drop it (its draft step is already paid)
            tokens.append(token)
            if len(tokens) == n or model.is_eog(token):  # nothing useful follows an end of generation
                break
            logits = model.eval([token])
        return Draft(tokens, None if q_rows is None else q_rows[: len(tokens)], source="model")


class NgramDrafter:
    """Prompt lookup: find the longest recent n-gram that ends the context and
    also occurs earlier in it (prompt or output), and propose what followed it.

    Free to run and strong when the answer repeats its input (code edits,
    refactors, quotes). Drafts are deterministic: point masses."""

    def __init__(self, sizes: Sequence[int] = (16, 8, 5, 3), max_tokens: int = 64) -> None:
        self.sizes = sorted(sizes, reverse=True)
        self.max_tokens = max_tokens
        self._seen: list[int] = []  # the context indexed so far
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}  # n-gram -> where its follower is
        self.last_match = 0  # length of the n-gram behind the last draft (0: none)

    def prefill(self, context: list[int]) -> None:
        self._update(context)

    def draft(self, context, n, params=None, rng=None, stop_below=()) -> Draft:
        self._update(context)
        for size in self.sizes:
            if len(context) > size and (start := self._index[size].get(tuple(context[-size:]))) is not None:
                self.last_match = size
                return Draft(context[start : start + min(n, self.max_tokens)], None, source="ngram")
        self.last_match = 0
        return Draft([], None, source="ngram")

    def _update(self, context: list[int]) -> None:
        """Index the n-grams of `context` not indexed yet, except those ending at its
        last token: they have no follower yet."""
        seen = self._seen
        if len(context) <= len(seen) or context[: len(seen)] != seen:  # a different conversation
            seen.clear()
            for table in self._index.values():
                table.clear()
        for end in range(len(seen), len(context) - 1):  # n-grams ending at `end`; later ones win
            for size in self.sizes:
                if end + 1 >= size:
                    self._index[size][tuple(context[end + 1 - size : end + 1])] = end + 1
        seen.extend(context[len(seen) : len(context) - 1])
