"""What every drafter hands the engine: a Draft, and the Drafter protocol it is made by."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..model import TREE_BRANCHES, Model, Pass
from ..modes import Source
from ..sampling import Constraint, Law, SamplingParams, law


@dataclass
class Draft:
    tokens: list[int]
    # the laws the tokens were sampled from (one per token; a tree's sibling: given the siblings
    # drawn before it); None means each token is a point mass (deterministic drafts, and every
    # greedy draft)
    q: list[Law] | None = None
    source: Source = Source.MODEL  # which kind of drafter made it: acceptance is tracked per source
    # a tree of drafts: tokens[i] follows tokens[parents[i]] (-1: the context), parents before
    # children, siblings in the order they are verified; None: a chain
    parents: list[int] | None = None
    # where the drafter branched: each node's chance of being taken where its parent is, as the
    # drafter judged it (the controller learns how far its siblings' chances are to be trusted)
    chances: list[float] | None = None

    def __post_init__(self) -> None:
        self.source = Source(self.source)  # (a drafter of the user's may name it as a string)

    @property
    def width(self) -> int:
        """The most children a node (or the context) has: 1 for a chain."""
        if self.parents is None:
            return 1
        return max(self.parents.count(parent) for parent in set(self.parents))

    @property
    def depth(self) -> int:
        """The longest branch's tokens (a chain's length)."""
        if self.parents is None:
            return len(self.tokens)
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 + (depths[parent] if parent >= 0 else 0))
        return max(depths, default=0)


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
        exact. A drafter whose `branches` attribute is true may also be given `branching` (a
        Branching), and then draft a tree (Draft.parents, Draft.chances; see Chain)."""

    def accept(self, context: list[int]) -> None:
        """A round is over: `context` is the sequence now (the drafts the target kept, and its token)."""


MAX_SIBLINGS = 3  # a tree's alternatives to a chain token, at most


@dataclass(frozen=True)
class Branching:
    """What a tree's shape is chosen by (the controller's, per round): a node is drafted where its
    chance of being taken beats cost(k), what one more token in a verify pass of k costs (in the
    plan's tokens: V(k + 1) - V(k) at its rate). A drafter's confidence in its rank-r sibling (1:
    the next likeliest after the chain's token) is weighed by trust[r - 1]: how often the target
    took its rank-r siblings against the chances it gave them (Sequoia's acceptance per rank,
    measured, on EAGLE-2's confidences; 1 before any evidence)."""

    cost: Callable[[int], float]
    trust: Sequence[float] = (1.0,) * MAX_SIBLINGS


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
    # a tree: a sibling is drafted where its path confidence beats what its place costs (None: a chain)
    branching: Branching | None = None

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
        parents: list[int] = []  # (a tree's: see Draft)
        chances: list[float] = []  # (likewise)
        parent = -1  # the chain's last token
        spine = 0  # the chain's tokens (a tree's siblings aside)
        p_all = 1.0  # the draft's own estimate that every token so far is accepted
        while True:
            z = logits[:shared]
            if params.greedy:
                token = int(np.argmax(z)) if walk is None else walk.argmax(z)
                # (without the constraint's mask: a hint is all it needs to be)
                weights = np.exp(z - z[token]) if stop_below or self.branching is not None else None
                confidence = 1.0 / weights.sum() if weights is not None else 1.0
            else:
                vocab = self.vocab
                q = law(z, params, vocab) if walk is None else walk.law(z, params, vocab)
                # the law's top probability, as for greedy, and never the drawn token's q(x): a
                # token kept or dropped by what was drawn is no longer drawn from q, and the answer
                # leaves the target's law (measured on the Qwen pair at temperature 0.6-1: the
                # expected acceptance sum(min(p, q)) was within 0.15 of max q; q(x) underestimates
                # it, 0.35-0.56 for tokens of q(x) 0.01-0.2)
                confidence = float(q.probs.max())
            if spine < len(stop_below) and p_all * confidence < stop_below[spine]:
                break  # not worth verifying: stop (its draft step is already paid)
            if not params.greedy:
                q_rows.append(q)
                token = q.sample(self.rng.random())
            at = len(tokens)
            tokens.append(token)
            parents.append(parent)
            chances.append(confidence)
            if self.branching is not None:  # where the draft is unsure, its next likeliest tokens too
                # (greedy: the softmax's likeliest, read from its weights: no law over the vocabulary)
                sampled = None if params.greedy else q
                likeliest = _likeliest(None, weights, 1 / confidence) if sampled is None else _likeliest(q.ids, q.probs)
                self._siblings(likeliest, sampled, token, p_all, parent, tokens, parents, chances, q_rows)
            p_all *= confidence
            parent, spine = at, spine + 1
            if spine == n or self.vocab.is_eog(token):  # nothing useful follows an end of generation
                break
            if walk is not None:
                walk.accept(token)
            logits = yield from step(token)
        if all(parent == i - 1 for i, parent in enumerate(parents)):  # a chain
            return Draft(tokens, q_rows, source=source)
        return Draft(tokens, q_rows, source=source, parents=parents, chances=chances)

    def _siblings(
        self,
        likeliest: list[tuple[int, float]],
        q: Law | None,
        drawn: int,
        p_all: float,
        parent: int,
        tokens: list[int],
        parents: list[int],
        chances: list[float],
        q_rows: list[Law] | None,
    ) -> None:
        """Siblings of `drawn` (the chain's token after `parent`), where the draft is unsure
        (EAGLE-2): as many as its next likeliest tokens (`likeliest`: (token, probability), the
        likeliest first) whose path confidence p_all·q(t), weighed by the trust learnt for its
        rank, beats what one more verified token costs. The count is read from the law alone,
        before drawing: greedy, the siblings are those tokens; sampled, draws from q without the
        tokens drawn before, each kept with the law it came from (as verify_tree needs)."""
        branching = self.branching
        candidates = [(token, prob) for token, prob in likeliest if token != drawn][:MAX_SIBLINGS]
        room = TREE_BRANCHES + 1 - leaves(parents)  # the branches a pass has left (a sibling is one more)
        count = 0
        for rank, (_, prob) in enumerate(candidates[:room], start=1):
            if p_all * prob * branching.trust[rank - 1] < branching.cost(len(tokens) + count + 1):
                break
            count += 1
        if q is None:
            siblings = [token for token, _ in candidates[:count]]
        else:
            siblings, rest = [], q
            for _ in range(count):
                if (rest := without(rest, drawn)) is None:
                    break
                drawn = rest.sample(self.rng.random())
                siblings.append(drawn)
                q_rows.append(rest)
        tokens += siblings
        parents += [parent] * len(siblings)
        chances += [prob for _, prob in candidates[: len(siblings)]]  # (sampled: the rank's, as judged before drawing)


def _likeliest(ids: np.ndarray | None, weights: np.ndarray, total: float = 1.0) -> list[tuple[int, float]]:
    """The MAX_SIBLINGS + 1 likeliest of a law's tokens (ids None: token i has weights[i]), as
    (token, probability: weight / total), the likeliest first: one partition, no sort of them all."""
    n = MAX_SIBLINGS + 1
    top = np.argpartition(-weights, n - 1)[:n] if len(weights) > n else np.arange(len(weights))
    top = top[np.argsort(-weights[top], kind="stable")]
    return [(int(i if ids is None else ids[i]), float(weights[i]) / total) for i in top]


def leaves(parents: list[int]) -> int:
    """A tree's leaves, by its parents (see Draft): the nodes no node names as its parent."""
    return len(parents) - len(set(parents) - {-1})


def without(q: Law, token: int) -> Law | None:
    """q with `token` taken out, renormalised (None: nothing left): the law of a draw without replacement."""
    kept = q.ids != token
    total = q.probs[kept].sum()
    return Law(q.ids[kept], q.probs[kept] / total) if total > 0 else None
