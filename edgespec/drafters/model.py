"""The draft model: a small model sharing the target's tokenizer drafts, sampling from its law."""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from ..model import Model, Pass, decoded_alone
from ..modes import Source
from ..sampling import Law, law
from .base import Draft


class ModelDrafter:
    """Drafts with a small model sharing the target's tokenizer. Its passes are handed out
    (begin_steps, draft_steps: each a model.Pass of the draft model) so that a scheduler decodes
    them with other runs' draft passes, every sequence's step reading the weights once; begin and
    draft decode them alone."""

    def __init__(self, model: Model, target_vocab: int) -> None:
        self.model = model
        self.target_vocab = target_vocab  # drafts stay within the ids the target has

    def begin(self, prompt: list[int]) -> None:
        decoded_alone(self.begin_steps(prompt))

    def begin_steps(self, prompt: list[int], chunk: int | None = None) -> Generator[Pass, None, None]:
        """begin(), its passes handed out: `chunk` tokens at most each (None: all in one), so that a
        long prompt's read holds the other runs' steps up for one pass at most."""
        ahead = prompt[self.model.sync(prompt) : -1]
        step = chunk or max(1, len(ahead))
        for at in range(0, len(ahead), step):
            yield from self._pass(ahead[at : at + step])

    def accept(self, context: list[int]) -> None:
        """Drop the rejected drafts from the cache (the tokens the target added are read at the next draft)."""
        self.model.sync(context)

    def draft(self, context, n, params, rng, stop_below=(), grammar=None) -> Draft:
        return decoded_alone(self.draft_steps(context, n, params, rng, stop_below, grammar))

    def draft_steps(self, context, n, params, rng, stop_below=(), grammar=None) -> Generator[Pass, None, Draft]:
        """draft(), its passes handed out."""
        model = self.model
        walk = grammar.clone() if grammar is not None else None  # the constraint along this draft
        logits = yield from self._pass(context[len(model.tokens) :])  # the tokens written since its last draft
        model.checkpoint()  # a recurrent state: the next round's sync comes back here
        tokens: list[int] = []
        q_rows: list[Law] | None = None if params.greedy else []  # the laws the tokens were drawn from
        p_all = 1.0  # the draft's own estimate that every token so far is accepted
        shared = min(model.n_vocab, self.target_vocab)  # token ids both vocabularies have
        while True:
            if params.greedy:
                token = int(np.argmax(logits)) if walk is None else walk.argmax(logits[:shared])
                # (without the constraint's mask: a hint is all it needs to be)
                confidence = 1.0 / np.exp(logits - logits[token]).sum() if stop_below else 1.0
            else:
                q = law(logits[:shared], params, model) if walk is None else walk.law(logits[:shared], params, model)
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
                token = q.sample(rng.random())
            tokens.append(token)
            if len(tokens) == n or model.is_eog(token):  # nothing useful follows an end of generation
                break
            if walk is not None:
                walk.accept(token)
            logits = yield from self._pass([token])
        return Draft(tokens, q_rows, source=Source.MODEL)

    def _pass(self, tokens: list[int]) -> Generator[Pass, None, np.ndarray]:
        """A pass of the draft model over `tokens` in its sequence, handed out to be decoded; its
        last row (the model back on this sequence)."""
        one = Pass(self.model.seq, tokens, model=self.model)
        yield one
        self.model.use(one.seq)
        return one.result()
