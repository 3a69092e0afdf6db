"""What every drafter hands the engine: a Draft, and the Drafter protocol it is made by."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..model import Model
from ..modes import Source
from ..sampling import Constraint, Law, SamplingParams


@dataclass
class Draft:
    tokens: list[int]
    # the laws the tokens were sampled from (one per token); None means each token is
    # a point mass (deterministic drafts, and every greedy draft)
    q: list[Law] | None = None
    source: Source = Source.MODEL  # which kind of drafter made it: acceptance is tracked per source

    def __post_init__(self) -> None:
        self.source = Source(self.source)  # (a drafter of the user's may name it as a string)


class Drafter(Protocol):
    """begin(prompt), then per round draft(...) and accept(context)."""

    model: Model | None  # the model it runs (None: a free drafter, which costs nothing to run)

    def begin(self, prompt: list[int]) -> None:
        """Get ready to draft after the request's prompt (timed as prefill)."""

    def draft(
        self,
        context: list[int],
        n: int,
        params: SamplingParams,
        rng: np.random.Generator,
        stop_below: Sequence[float] = (),
        grammar: Constraint | None = None,
    ) -> Draft:
        """Propose up to n tokens to follow `context`. A drafter that knows its
        confidence stops before token i once the product of its confidences in
        tokens 0..i falls below stop_below[i] (a hint; others may ignore it).
        grammar: what the answer is held to (its grammar, or its token healing) in its
        state after `context` (not to be advanced: clone it to walk ahead); a drafter
        that samples draws from its law (constraint.law), so that min(1, p_g/q_g) stays
        exact."""

    def accept(self, context: list[int]) -> None:
        """A round is over: `context` is the sequence now (the drafts the target kept, and its token)."""
