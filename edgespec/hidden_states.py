"""The hidden states a target's decodes leave (its last layer's output, a row per position),
kept per sequence for MTP layers that have not read them yet (heads.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import llama_cpp
import llama_cpp.llama_cpp_ext as llama_ext
import numpy as np

from .errors import EngineFault

HIDDEN_MEMORY = 64 << 20  # bytes of hidden states a sequence keeps for MTP layers that have not read them


@dataclass
class HiddenStates:
    """The hidden states of consecutive positions from `at` on (a row each), as the target's last
    layer left them: what MTP layers read (heads.py)."""

    at: int
    blocks: list[np.ndarray] = field(default_factory=list)  # of rows, one per decode

    @property
    def end(self) -> int:
        return self.at + sum(len(block) for block in self.blocks)

    def add(self, newer: HiddenStates, limit: int = HIDDEN_MEMORY) -> HiddenStates:
        """These, with `newer`'s rows in place of those from newer.at on (where they do not follow
        or overlap these: newer's alone); the oldest blocks dropped past `limit` bytes."""
        kept = self.cut(newer.at) if self.at <= newer.at <= self.end else None
        kept = HiddenStates(newer.at) if kept is None else kept
        kept.blocks += newer.blocks
        while sum(block.nbytes for block in kept.blocks) > limit and len(kept.blocks) > 1:
            kept.at += len(kept.blocks.pop(0))
        return kept

    def cut(self, n: int) -> HiddenStates | None:
        """Those of the positions before n (None: none)."""
        if n <= self.at:
            return None
        if n >= self.end:
            return HiddenStates(self.at, list(self.blocks))
        return HiddenStates(self.at, [self.rows(self.at, n)])

    def rows(self, first: int, end: int) -> np.ndarray:
        """The rows of positions first..end-1 (all held), read from the blocks they lie in alone
        (a round reads a few rows of a long text's)."""
        parts, at = [], self.at
        for block in self.blocks:
            if at < end and first < at + len(block):
                parts.append(block[max(first - at, 0) : end - at])
            at += len(block)
        return np.concatenate(parts) if parts else np.empty((0, self.blocks[0].shape[1]), np.float32)


class HiddenExport:
    """A model's hidden states, kept per sequence as its decodes write them (off until export()).
    `model` is the Model whose context writes them."""

    def __init__(self, model) -> None:
        self.model = model
        self.width = 0  # > 0: each decode's hidden states kept per sequence

    def export(self) -> None:
        """From now on keep the hidden state of every position each decode writes, per sequence,
        until take() (for MTP layers, heads.py)."""
        self.width = llama_cpp.llama_model_n_embd_out(self.model.llama_model)
        self.switch_on()

    def switch_on(self) -> None:
        """The model's context told to keep them, of every token and not only the output rows
        (again for a context made anew)."""
        llama_ext.llama_set_embeddings_nextn(self.model.llama_context, True, False)

    def take(self) -> HiddenStates | None:
        """The hidden states the current sequence's decodes kept since the last take (None: none)."""
        hidden, self.model.state.hidden = self.model.state.hidden, None
        return hidden

    def written(self, index: int, count: int, end: int) -> HiddenStates | None:
        """After a decode: the hidden states of its tokens index..index+count-1, which a sequence
        holds at the `count` positions before `end` (None: not exported)."""
        if not self.width:
            return None
        return HiddenStates(end - count, [self.rows(index + count)[index:].copy()])

    def rows(self, count: int) -> np.ndarray:
        """The hidden states of the last decode's first `count` tokens (a view into llama.cpp's
        buffer, valid until the next decode)."""
        states = llama_ext.llama_get_embeddings_nextn(self.model.llama_context)
        if not states:
            raise EngineFault(f"llama.cpp kept no hidden states of {self.model.path.name}; use --no-draft")
        return np.ctypeslib.as_array(states, shape=(count, self.width))
