"""The target's own multi-token-prediction layers (heads.Heads) as a drafter: no second model file.

A chain, as llama.cpp drafts with them: the layers read the round's last token with the target's
hidden state before it and give the first draft token, then read each draft token with their own
hidden state to give the next. Trained for the first of these only (DeepSeek-V3, GLM-4.5 and
Qwen3.5 train one MTP layer to predict one token ahead), so acceptance falls along the chain, and
the controller's stop_below ends it where it no longer pays. Where the target verifies trees, the
layers' next likeliest tokens go beside the chain's where their chance pays for their place in the
pass (Chain): no layer step more, and the target's hidden states of the branch it took are kept.

Each position p the layers hold is the context's token there with the target's hidden state at
p - 1 (zeros before the first), written when the target has decoded p - 1 (its hidden states are
kept per sequence: HiddenExport.export); a draft's own positions, read with the layers' own states,
are cut before the next is written.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np

from ..heads import Heads
from ..hidden_states import HiddenStates
from ..modes import Source
from ..passes import Pass, decoded_alone
from ..prompt_cache import common_prefix
from .base import Chain, Draft, Drafter


@dataclass
class Written:
    """What the layers hold in one sequence: `tokens` at positions start.., and the target's
    hidden states of this text (to write again from where a later text parts from it)."""

    start: int = 0
    tokens: list[int] = field(default_factory=list)
    hidden: HiddenStates | None = None


class HeadsDrafter(Drafter):
    """Drafts with the target's MTP layers (see the module docstring)."""

    source = Source.HEADS
    branches = True  # it drafts trees where it is unsure (Chain.branching): its next likeliest tokens

    def __init__(self, heads: Heads) -> None:
        self.heads = heads
        self.target = heads.target
        self._written = [Written() for _ in range(self.target.n_seq)]

    @property
    def name(self) -> str:
        return "its own MTP heads"  # no model of its own: its step is priced apart (MachineCosts.draft_step)

    def close(self) -> None:
        self.heads.close()  # (a context on the target's weights: freed before them)

    def begin(self, prompt: list[int]) -> None:
        """The prompt's positions the target has decoded, written (the target's last token is read
        with the first draft)."""
        self._write(prompt[:-1])

    def accept(self, context: list[int]) -> None:
        """Nothing to do: the next draft cuts this one's positions before writing the context's."""

    def draft(self, context, n, params, rng, stop_below=(), grammar=None, branching=None) -> Draft:
        first = self._write(context)
        if first is None:  # the target's hidden states before the context's end are gone (a restored prompt)
            return Draft([], None, source=Source.HEADS)
        logits, state = first
        seq = self.target.seq

        def step(token: int) -> Generator[Pass, None, np.ndarray]:  # a generator, as Chain wants
            nonlocal state
            logits, state = self.heads.read(seq, [token], state[None])
            return logits
            yield  # (never reached: the layers' reads are not handed out to be decoded with others)

        chain = Chain(params, rng, stop_below, grammar, self.target, self.target.n_vocab, branching)
        return decoded_alone(chain.draft(logits, n, step, Source.HEADS))

    def _write(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """Write the positions of `tokens` the layers lack (at least the last, whose logits are
        wanted) with the target's hidden states before them: the logits and state after the last
        (None: the state before the last token is not known: a restored prompt's)."""
        seq, length = self.target.seq, len(tokens)
        if not length:
            return None
        written = self._written[seq]
        held = common_prefix(written.tokens, tokens[written.start :], length) if written.start < length else 0
        same = written.start + held if held or written.start == 0 else 0  # positions of this text held
        kept = min(same, length - 1)  # (the last is written again: its logits are wanted)
        hidden = written.hidden.cut(same) if written.hidden is not None else None  # (later ones: other text's)
        if (taken := self.target.hidden.take()) is not None:
            hidden = taken if hidden is None else hidden.add(taken)
        written.hidden = hidden
        if length > 1 and (hidden is None or hidden.end < length - 1):
            return None
        if length > 1 and max(kept - 1, 0) < hidden.at:  # the states before the kept end are gone: start after them
            kept = hidden.at + 1
        if kept < written.start or kept - written.start > len(written.tokens):  # a new start
            self.heads.cut(seq, 0)
            written.start, written.tokens = kept, []
        else:
            self.heads.cut(seq, kept)
            del written.tokens[kept - written.start :]
        before = hidden.rows(max(kept - 1, 0), length - 1) if length > 1 else np.empty((0, self.heads.width))
        if kept == 0:  # nothing comes before the first position
            before = np.vstack([np.zeros((1, self.heads.width), np.float32), before])
        result = self.heads.read(seq, tokens[kept:], before)
        written.tokens += tokens[kept:]
        return result
