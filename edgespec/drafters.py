"""Drafters: each proposes the next few tokens; the engine verifies them.

Like llama.cpp's common/speculative.cpp, making a draft is split from verifying
it: the engine does not care where a draft came from, only that q (if given)
is the distribution each token was drawn from.
"""

from __future__ import annotations

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


class Drafter(Protocol):
    def prefill(self, context: list[int]) -> None:
        """Optionally get ready for drafts after `context` (timed as prefill)."""

    def draft(self, context: list[int], n: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """Propose up to n tokens to follow `context`."""


class ModelDrafter:
    """Drafts with a small model sharing the target's tokenizer."""

    def __init__(self, model: Model, target_vocab: int) -> None:
        self.model = model
        self.target_vocab = target_vocab  # q rows are padded to the target's vocabulary size

    def prefill(self, context: list[int]) -> None:
        kept = self.model.sync(context)
        self.model.eval(context[kept:-1])

    def draft(self, context: list[int], n: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        model = self.model
        # the cache may hold rejected drafts from the last round: keep only the agreed prefix
        kept = model.sync(context)
        logits = model.eval(context[kept:])
        tokens: list[int] = []
        q_rows: list[np.ndarray] = []
        while True:
            if params.greedy:
                token = int(np.argmax(logits))
            else:
                q = np.zeros(self.target_vocab)
                q[: model.n_vocab] = distribution(logits, params)[: self.target_vocab]
                q /= q.sum()
                token = sample(q, rng)
                q_rows.append(q)
            tokens.append(token)
            if len(tokens) == n or model.is_eog(token):  # nothing useful follows an end of generation
                break
            logits = model.eval([token])
        return Draft(tokens, np.stack(q_rows) if q_rows else None)
