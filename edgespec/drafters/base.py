"""What every drafter hands the engine: a Draft, and the Drafter protocol it is made by."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..heads import Heads
from ..model import TREE_BRANCHES, Model
from ..modes import Source
from ..passes import Pass
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
    grown: int = 0  # the drafter's passes that grew branches below its siblings (beside its chain's steps)

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


class Drafter:
    """begin(prompt), then per round draft(...) and accept(context): every drafter subclasses it
    (a user's too). The engine takes each drafter's passes the same way, from begin_steps and
    draft_steps: a drafter that runs a model hands its passes out there, to be decoded beside other
    requests'; the others' steps are their plain calls."""

    model: Model | None = None  # the model it runs (None: a free drafter, which costs nothing to run)
    heads: Heads | None = None  # the target's MTP layers it runs instead (their step is priced apart)
    source: Source = Source.MODEL  # what its drafts are learnt as, where it is the engine's drafter
    branches: bool = False  # it may draft a tree where it is unsure (given `branching`, see draft)

    @property
    def name(self) -> str | None:
        """What drafts, as the shells name it: its model's file (None: no model)."""
        return self.model.path.name if self.model is not None else None

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
        raise NotImplementedError

    def accept(self, context: list[int]) -> None:
        """A round is over: `context` is the sequence now (the drafts the target kept, and its token)."""

    def begin_steps(self, prompt: list[int], chunk: int | None = None) -> Generator[Pass, None, None]:
        """begin(), its passes handed out, `chunk` tokens at most each (a free drafter has none)."""
        self.begin(prompt)
        yield from ()

    def draft_steps(self, context, n, params, rng, stop_below=(), grammar=None, **tree) -> Generator[Pass, None, Draft]:
        """draft(), its passes handed out (a free drafter has none)."""
        yield from ()
        return self.draft(context, n, params, rng, stop_below, grammar=grammar, **tree)

    def close(self) -> None:
        """Free what it holds beside its model (the engine closes the models it owns)."""


MAX_SIBLINGS = 3  # a tree's alternatives to a chain token, at most
# a drafter's rows after the context's last token and after each node of a tree (tokens, parents), in one pass
TreeRows = Callable[[list[int], list[int]], Generator[Pass, None, np.ndarray]]


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
    # what a pass of the drafter over k tokens costs, in the plan's tokens (see Chain._grow; None: none is made)
    pass_cost: Callable[[int], float] | None = None


@dataclass
class Nodes:
    """A draft as it is made (see Draft): per node its token, parent, own chance (of being taken
    where its parent is), path chance (the drafter's estimate that it is reached and taken), depth
    (1: after the context), and, sampled, the law it was drawn from."""

    q_rows: list[Law] | None  # None: greedy
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    chances: list[float] = field(default_factory=list)
    paths: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, chance: float, path: float, q: Law | None) -> int:
        """Node `token` after `parent`; its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.chances.append(chance)
        self.paths.append(path)
        self.depths.append(self.depth(parent) + 1)
        if self.q_rows is not None:
            self.q_rows.append(q)
        return len(self.tokens) - 1

    def path(self, node: int) -> float:
        return 1.0 if node < 0 else self.paths[node]

    def depth(self, node: int) -> int:
        return 0 if node < 0 else self.depths[node]

    def draft(self, source: Source, grown: int) -> Draft:
        if all(parent == i - 1 for i, parent in enumerate(self.parents)):  # a chain
            return Draft(self.tokens, self.q_rows, source=source)
        return Draft(self.tokens, self.q_rows, source, self.parents, self.chances, grown)


@dataclass
class Read:
    """What a drafter's logits after a node say: greedy, the likeliest token (and, where a hint
    is wanted, every token's weight against it); sampled, the law to draw from; the confidence."""

    token: int | None
    confidence: float
    q: Law | None = None
    weights: np.ndarray | None = None

    def likeliest(self) -> list[tuple[int, float]]:
        """(greedy: the softmax's likeliest, read from its weights: no law over the vocabulary)"""
        if self.q is None:
            return _likeliest(None, self.weights, 1 / self.confidence)
        return _likeliest(self.q.ids, self.q.probs)


@dataclass
class Chain:
    """A chain of drafts from a model's logits, one token a step: what the draft model and the
    target's own heads share. Greedy, each step's argmax; sampled, a draw from its law q (kept
    for the acceptance test); under a constraint, both from its law (constraint.law), so that
    min(1, p_g/q_g) stays exact. Stops where the drafter's confidence falls below stop_below
    (see Drafter.draft), at an end of generation, or after n tokens. Given branching, a tree:
    siblings beside the chain's tokens, and where the drafter reads a tree in one pass, branches
    grown below them (see draft)."""

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
        tree_rows: TreeRows | None = None,
    ) -> Generator[Pass, None, Draft]:
        """The chain from `logits` (of the token after the context); step(token) gives the logits
        after `token` (its passes handed out). tree_rows(tokens, parents): the drafter's rows after
        the context's last token and after each node of a tree, in one pass (None: siblings stay
        leaves)."""
        stop_below = self.stop_below
        walk = self.grammar.clone() if self.grammar is not None else None  # the constraint along this draft
        nodes = Nodes(None if self.params.greedy else [])
        node, chain = -1, []  # the chain's last token, and all its tokens (a tree's siblings aside)
        while True:
            read = self._read(logits, walk, bool(stop_below) or self.branching is not None)
            depth = nodes.depth(node)
            if depth < len(stop_below) and nodes.path(node) * read.confidence < stop_below[depth]:
                break  # not worth verifying: stop (its draft step is already paid)
            node = self._take(read, node, nodes)
            chain.append(node)
            token = nodes.tokens[node]
            if depth + 1 == n or self.vocab.is_eog(token):  # nothing useful follows an end of generation
                break
            if walk is not None:
                walk.accept(token)
            logits = yield from step(token)
        grown = 0
        if tree_rows is not None and self.branching is not None and self.branching.pass_cost is not None:
            grown = yield from self._grow(nodes, tree_rows, set(chain))
        return nodes.draft(source, grown)

    def _read(self, logits: np.ndarray, walk: Constraint | None, weigh: bool) -> Read:
        z = logits[: self.shared]
        if self.params.greedy:
            token = int(np.argmax(z)) if walk is None else walk.argmax(z)
            # (without the constraint's mask: a hint is all it needs to be)
            weights = np.exp(z - z[token]) if weigh else None
            return Read(token, 1.0 / weights.sum() if weights is not None else 1.0, weights=weights)
        q = law(z, self.params, self.vocab) if walk is None else walk.law(z, self.params, self.vocab)
        # the law's top probability, as for greedy, and never the drawn token's q(x): a token
        # kept or dropped by what was drawn is no longer drawn from q, and the answer leaves the
        # target's law (measured on the Qwen pair at temperature 0.6-1: the expected acceptance
        # sum(min(p, q)) was within 0.15 of max q; q(x) underestimates it, 0.35-0.56 for tokens
        # of q(x) 0.01-0.2)
        return Read(None, float(q.probs.max()), q)

    def _take(self, read: Read, parent: int, nodes: Nodes) -> int:
        """The node `read` gives after `parent` (sampled: drawn now), and, branching, its siblings
        where they pay; the node's index."""
        token = read.token if read.q is None else read.q.sample(self.rng.random())
        path = nodes.path(parent)
        node = nodes.add(token, parent, read.confidence, path * read.confidence, read.q)
        if self.branching is not None:  # where the draft is unsure, its next likeliest tokens too
            self._siblings(read, token, parent, nodes)
        return node

    def _siblings(self, read: Read, drawn: int, parent: int, nodes: Nodes) -> None:
        """Siblings of `drawn` (the token after `parent`), where the draft is unsure (EAGLE-2):
        as many as its next likeliest tokens whose path confidence (the parent's, times q(t)),
        weighed by the trust learnt for its rank, beats what one more verified token costs. The
        count is read from the law alone, before drawing: greedy, the siblings are those tokens;
        sampled, draws from q without the tokens drawn before, each kept with the law it came
        from (as verify_tree needs)."""
        branching, path = self.branching, nodes.path(parent)
        candidates = [(token, prob) for token, prob in read.likeliest() if token != drawn][:MAX_SIBLINGS]
        room = TREE_BRANCHES + 1 - leaves(nodes.parents)  # the branches a pass has left (a sibling is one more)
        chances = [path * prob * trust for (_, prob), trust in zip(candidates[:room], branching.trust, strict=False)]
        count = 0
        while count < len(chances) and chances[count] >= branching.cost(len(nodes.tokens) + count + 1):
            count += 1
        rest = read.q
        for (token, prob), chance in zip(candidates[:count], chances, strict=False):
            if rest is not None:  # sampled: (the rank's chance, as judged before drawing)
                if (rest := without(rest, drawn)) is None:
                    break
                token = drawn = rest.sample(self.rng.random())
            nodes.add(token, parent, prob, chance, rest)

    def _grow(self, nodes: Nodes, tree_rows: TreeRows, chain: set[int]) -> Generator[Pass, None, int]:
        """Branches below the siblings, a level a pass of the drafter over the whole tree: each
        frontier node's next token (and its siblings) where its path chance beats its place in
        the verify pass, no deeper than the chain; a pass is made while the frontier's path
        chances outweigh what it costs (branching.pass_cost). Returns the passes."""
        depth = len(chain)
        frontier = [i for i in range(len(nodes.tokens)) if i not in chain and not self.vocab.is_eog(nodes.tokens[i])]
        passes = 0
        while frontier := [f for f in frontier if nodes.depths[f] < depth]:
            if sum(nodes.paths[f] for f in frontier) < self.branching.pass_cost(1 + len(nodes.tokens)):
                break
            rows = yield from tree_rows(nodes.tokens, nodes.parents)
            passes += 1
            grown = len(nodes.tokens)
            for f in frontier:
                read = self._read(rows[f + 1], None, weigh=True)
                if nodes.paths[f] * read.confidence >= self.branching.cost(len(nodes.tokens) + 1):
                    self._take(read, f, nodes)
            frontier = [i for i in range(grown, len(nodes.tokens)) if not self.vocab.is_eog(nodes.tokens[i])]
        return passes


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
