"""The draft model: a small model sharing the target's tokenizer drafts, sampling from its law."""

from __future__ import annotations

from collections.abc import Generator
from functools import partial

import numpy as np

from ..model import Model
from ..modes import Source
from ..passes import Pass, decoded_alone
from .base import Chain, Draft, Drafter


class ModelDrafter(Drafter):
    """Drafts with a small model sharing the target's tokenizer. Its passes are handed out
    (begin_steps, draft_steps: each a passes.Pass of the draft model) so that a scheduler decodes
    them with other runs' draft passes, every sequence's step reading the weights once; begin and
    draft decode them alone."""

    branches = True  # it drafts trees where it is unsure (Chain.branching)

    def __init__(self, model: Model, target_vocab: int) -> None:
        self.model = model
        self.target_vocab = target_vocab  # drafts stay within the ids the target has

    def begin(self, prompt: list[int]) -> None:
        decoded_alone(self.begin_steps(prompt))

    def begin_steps(self, prompt: list[int], chunk: int | None = None) -> Generator[Pass, None, None]:
        """begin(), its passes handed out: `chunk` tokens at most each (None: all in one), so that a
        long prompt's read holds the other runs' steps up for one pass at most."""
        ahead = prompt[self.model.cache.sync(prompt, prompt=True) : -1]
        step = chunk or max(1, len(ahead))
        for at in range(0, len(ahead), step):
            yield from self._pass(ahead[at : at + step])

    def accept(self, context: list[int]) -> None:
        """Drop the rejected drafts from the cache (the tokens the target added are read at the next draft)."""
        self.model.cache.sync(context)

    def draft(self, context, n, params, rng, stop_below=(), grammar=None, branching=None) -> Draft:
        return decoded_alone(self.draft_steps(context, n, params, rng, stop_below, grammar, branching))

    def draft_steps(
        self, context, n, params, rng, stop_below=(), grammar=None, branching=None
    ) -> Generator[Pass, None, Draft]:
        """draft(), its passes handed out; branching: a tree's (see Chain), None for a chain."""
        model = self.model
        logits = yield from self._pass(context[len(model.tokens) :])  # the tokens written since its last draft
        model.cache.checkpoint()  # a recurrent state: the next round's sync comes back here
        shared = min(model.n_vocab, self.target_vocab)
        chain = Chain(params, rng, stop_below, grammar, model, shared, branching)
        tree_rows = partial(self._tree_rows, context) if branching is not None and model.can_branch else None
        return (yield from chain.draft(logits, n, lambda token: self._pass([token]), Source.MODEL, tree_rows))

    def _tree_rows(self, context, tokens: list[int], parents: list[int]) -> Generator[Pass, None, np.ndarray]:
        """Its rows after the context's last token and after each node of a tree (see Pass.parents),
        in one pass handed out: the tree is read again from that token, each node after its own
        branch; the cache is left holding the context."""
        model = self.model
        model.cache.cut(len(context) - 1)
        one = Pass(model.seq, [context[-1], *tokens], len(tokens) + 1, model=model, parents=parents)
        yield one
        model.use(one.seq)
        rows = one.result()
        model.cache.keep([])
        return rows

    def _pass(self, tokens: list[int]) -> Generator[Pass, None, np.ndarray]:
        """A pass of the draft model over `tokens` in its sequence, handed out to be decoded; its
        last row (the model back on this sequence)."""
        one = Pass(self.model.seq, tokens, model=self.model)
        yield one
        self.model.use(one.seq)
        return one.result()
