"""What every drafter hands the engine: a Draft, and the Drafter protocol it is made by."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..model import Model, Pass
from ..modes import Source
from ..sampling import Constraint, Law, SamplingParams, law


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


@dataclass
class Chain:
    """A chain of drafts from a model's logits, one token a step: what the draft model and the
    target's own heads share. Greedy, each step's argmax; sampled, a draw from its law q (kept
    for the acceptance test); under a constraint, both from its law (constraint.law), so that
    min(1, p_g/q_g) stays exact. Stops where the drafter's confidence falls below stop_below
    (see Drafter.draft), at an end of generation, or after n tokens."""

    params: SamplingParams
    rng: np.random.Generator
    stop_below: Sequence[float]
    grammar: Constraint | None
    vocab: Model  # whose end-of-generation tokens end a draft, and whose sampler settings apply
    shared: int  # token ids the target has too: drafts stay within them

    def draft(
        self,
        logits: np.ndarray,
        n: int,
        step: Callable[[int], Generator[Pass, None, np.ndarray]],
        source: Source,
    ) -> Generator[Pass, None, Draft]:
        """The chain from `logits` (of the token after the context); step(token) gives the logits
        after `token` (its passes handed out)."""
        params, stop_below, shared = self.params, self.stop_below, self.shared
        walk = self.grammar.clone() if self.grammar is not None else None  # the constraint along this draft
        tokens: list[int] = []
        q_rows: list[Law] | None = None if params.greedy else []  # the laws the tokens were drawn from
        p_all = 1.0  # the draft's own estimate that every token so far is accepted
        while True:
            if params.greedy:
                token = int(np.argmax(logits[:shared])) if walk is None else walk.argmax(logits[:shared])
                # (without the constraint's mask: a hint is all it needs to be)
                confidence = 1.0 / np.exp(logits[:shared] - logits[token]).sum() if stop_below else 1.0
            else:
                vocab = self.vocab
                q = law(logits[:shared], params, vocab) if walk is None else walk.law(logits[:shared], params, vocab)
                # the law's top probability, as for greedy, and never the drawn token's q(x): a
                # token kept or dropped by what was drawn is no longer drawn from q, and the answer
                # leaves the target's law (measured on the Qwen pair at temperature 0.6-1: the
                # expected acceptance sum(min(p, q)) was within 0.15 of max q; q(x) underestimates
                # it, 0.35-0.56 for tokens of q(x) 0.01-0.2)
                confidence = float(q.probs.max())
            p_all *= confidence
            if len(tokens) < len(stop_below) and p_all < stop_below[len(tokens)]:
                break  # not worth verifying: stop (its draft step is already paid)
            if not params.greedy:
                q_rows.append(q)
                token = q.sample(self.rng.random())
            tokens.append(token)
            if len(tokens) == n or self.vocab.is_eog(token):  # nothing useful follows an end of generation
                break
            if walk is not None:
                walk.accept(token)
            logits = yield from step(token)
        return Draft(tokens, q_rows, source=source)
