"""Saved KV states of earlier prompts, so that conversations which alternate (an
assistant's edit chat and its commit-message requests, an agent's tool loop, two editor
windows) each pay only for their new part.

A model's context holds one sequence. When a prompt would throw away MIN_TOKENS or more
of it, that state is copied out first (llama_state_seq_get_data, into RAM); when a
prompt shares a longer prefix with a saved state than with the live cache, that state is
copied back in (llama_state_seq_set_data). The states of all models of an engine share
one budget in bytes, the least recently used going first. A recurrent or hybrid model's
state is reused only where the prompt continues all of it: its running state cannot be
cut back to a shorter prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_CACHE_RAM_MIB = 1024  # about ten 2,500-token Qwen2.5-1.5B prompts with their draft model's
# a shorter prefix costs less to evaluate again than to keep and copy back; and more than a
# decode round ever discards (a 64-token draft), so rounds never save states
MIN_TOKENS = 128


@dataclass
class SavedState:
    owner: int  # id() of the model whose context it came from
    tokens: list[int]  # what it holds
    data: Any  # llama.cpp's serialized sequence (a ctypes byte array)

    @property
    def size(self) -> int:
        return len(self.data)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:  # the usual case, compared in C
        return limit
    return next(i for i in range(limit) if a[i] != b[i])


class PromptCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.states: list[SavedState] = []  # least recently used first

    @property
    def size(self) -> int:
        return sum(s.size for s in self.states)

    def swap(self, model, tokens: list[int], kept: int) -> int:
        """Before `model`'s cache is cut to its first `kept` tokens to evaluate `tokens`
        (all but the last, whose logits the caller needs): keep what would be lost, and
        bring back a saved state that shares more of `tokens`. Returns the tokens the
        model's cache now shares with `tokens`."""
        limit = len(tokens) - 1

        def reusable(state: SavedState) -> int:
            shared = common_prefix(state.tokens, tokens, limit)
            # a recurrent state holds its whole prefix or nothing: it cannot be cut back
            return shared if not model.recurrent or shared == len(state.tokens) else 0

        best = max((s for s in self.states if s.owner == id(model)), key=reusable, default=None)
        reuse = reusable(best) if best else 0
        if len(model.tokens) - kept >= MIN_TOKENS:
            self._save(model)
        if reuse >= kept + MIN_TOKENS and model.restore_state(best.tokens, best.data):
            self.states.remove(best)
            self.states.append(best)  # now the most recently used
            return reuse
        return kept

    def drop(self, model) -> None:
        """Forget `model`'s states (its context was made anew)."""
        self.states = [s for s in self.states if s.owner != id(model)]

    def _save(self, model) -> None:
        tokens = list(model.tokens)
        mine = [s for s in self.states if s.owner == id(model)]
        # a saved state already holds all of it (a recurrent one only if it ends there: it cannot be cut back)
        if any((s.tokens == tokens) if model.recurrent else (s.tokens[: len(tokens)] == tokens) for s in mine):
            return
        data = model.save_state()
        if data is None or len(data) > self.budget:
            return
        # a state whose tokens the new one continues is superseded by it
        self.states = [s for s in self.states if not (s.owner == id(model) and tokens[: len(s.tokens)] == s.tokens)]
        self.states.append(SavedState(id(model), tokens, data))
        while self.size > self.budget:
            self.states.pop(0)
