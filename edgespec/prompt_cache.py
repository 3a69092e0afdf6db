"""Saved KV states of earlier prompts, so that conversations which alternate (an
assistant's edit chat and its commit-message requests, an agent's tool loop, two editor
windows) each pay only for their new part.

A sequence of a model's context holds one prompt. When a prompt would throw away MIN_TOKENS or more
of it, that state is copied out first (llama_state_seq_get_data, into RAM); when a
prompt shares a longer prefix with a saved state than with the live cache (by
MIN_RESTORED tokens), that state is copied back in (llama_state_seq_set_data). Idle work
that a request interrupts (an editor's next head, read a few tokens at a time) keeps what
it read the same way (keep), whatever its length. The states of all models of an engine share
one budget in bytes, the least recently used going first. A recurrent or hybrid model's
state is reused only where the prompt continues all of it: its running state cannot be
cut back to a shorter prefix.

A server keeps them on disk between runs (save_to_disk when it stops, load_from_disk when it
starts), within the same budget: an agent's first request of the day (Claude Code's 20k-token
system prompt and tools) then costs what its second does. A state is valid only for the model
file, llama.cpp build and flash-attention setting it came from, so each has a folder of its
own; every file carries its tokens and the sha256 of its data, and one that does not verify
is removed.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cache import cache_dir, locked, replace_atomically
from .store import build

DEFAULT_CACHE_RAM_MIB = 1024  # about ten 2,500-token Qwen2.5-1.5B prompts with their draft model's
# a shorter prefix costs less to evaluate again than to keep and copy back; and more than a
# decode round ever discards (a 64-token draft), so rounds never save states
MIN_TOKENS = 128
# copying a state back takes milliseconds (6 ms for 2,000 tokens of Qwen2.5-1.5B on a 2-core
# AMD EPYC, where reading 16 tokens again takes 240 ms): worth it from a few tokens on
MIN_RESTORED = 16
MAGIC = b"edgespec prompt state 1\n"
MAX_HEADER = 64 << 20  # bytes of a file's header (its tokens as JSON)


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


def reusable_prefix(held: list[int], tokens: list[int], limit: int, recurrent: bool) -> int:
    """How many of `tokens` (at most `limit`) a state holding `held` gives a prompt: their common
    prefix; a recurrent state holds its whole prefix or nothing (it cannot be cut back)."""
    shared = common_prefix(held, tokens, limit)
    return shared if not recurrent or shared == len(held) else 0


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
        best, reuse = self._best(model, tokens, len(tokens) - 1)
        if len(model.tokens) - kept >= MIN_TOKENS:
            self.keep(model)
        if reuse >= kept + MIN_RESTORED and model.cache.restore_state(best.tokens, best.data):
            # now the most recently used; saving the live state may have pushed it out of the budget
            self.states = [s for s in self.states if s is not best] + [best]
            self._fit()
            return reuse
        return kept

    def reusable(self, model, tokens: list[int]) -> int:
        """How many of `tokens` the best of `model`'s saved states holds (nothing is moved)."""
        return self._best(model, tokens, len(tokens))[1]

    def _best(self, model, tokens: list[int], limit: int) -> tuple[SavedState | None, int]:
        """The saved state of `model` that shares most of `tokens` (at most `limit`), and how many."""

        def reusable(state: SavedState) -> int:
            return reusable_prefix(state.tokens, tokens, limit, model.recurrent)

        best = max((s for s in self.states if s.owner == id(model)), key=reusable, default=None)
        return best, reusable(best) if best else 0

    def drop(self, model) -> None:
        """Forget `model`'s states (its context was made anew)."""
        self.states = [s for s in self.states if s.owner != id(model)]

    def keep(self, model) -> None:
        """Save `model`'s live state (unless a saved one holds it already)."""
        tokens = list(model.tokens)
        mine = [s for s in self.states if s.owner == id(model)]
        # a saved state already holds all of it (a recurrent one only if it ends there: it cannot be cut back)
        if any((s.tokens == tokens) if model.recurrent else (s.tokens[: len(tokens)] == tokens) for s in mine):
            return
        data = model.cache.save_state()
        if data is None or len(data) > self.budget:
            return
        # a state whose tokens the new one continues is superseded by it
        self.states = [s for s in self.states if not (s.owner == id(model) and tokens[: len(s.tokens)] == s.tokens)]
        self.states.append(SavedState(id(model), tokens, data))
        self._fit()

    def _fit(self) -> None:
        """The least recently used states out, until the rest fit the budget."""
        while self.size > self.budget:
            self.states.pop(0)

    # --- on disk, between runs ----------------------------------------------------------
    def save_to_disk(self, models) -> int:
        """Write the saved states, each model's live one first among them, to disk (most recent
        first, within the budget), replacing what the models' folders held. Returns bytes kept."""
        for model in models:
            for seq in range(model.n_seq):
                model.use(seq)
                if len(model.tokens) >= MIN_TOKENS:
                    self.keep(model)
        folders = {id(model): state_folder(model) for model in models}
        kept: dict[Path, set[str]] = {folder: set() for folder in folders.values()}
        total, stamp = 0, time.time()
        for rank, state in enumerate(reversed(self.states)):
            if state.owner not in folders or total + state.size > self.budget:
                continue
            folder = folders[state.owner]
            path = folder / f"{hashlib.sha256(repr(state.tokens).encode()).hexdigest()[:24]}.state"
            with locked(f"prompts-{folder.name}", None):
                folder.mkdir(parents=True, exist_ok=True)
                if not path.exists():  # the same tokens of the same model file: the same state
                    _write(path, state)
                os.utime(path, (stamp - rank, stamp - rank))  # newest first when loaded
            kept[folder].add(path.name)
            total += state.size
        for folder, names in kept.items():
            for old in folder.glob("*.state"):
                if old.name not in names:
                    old.unlink(missing_ok=True)
        return total

    def load_from_disk(self, models) -> int:
        """Take in the states save_to_disk kept for these models (most recent first, within the
        budget); a file that does not verify (a disk that lost part of a write, a copy cut short)
        is set aside as NAME.damaged, said in one line, the others taken. Returns how many were taken."""
        files = [(path, model) for model in models for path in state_folder(model).glob("*.state")]
        files.sort(key=lambda found: _mtime(found[0]), reverse=True)
        loaded = 0
        for path, model in files:
            if self.size + _size(path) > self.budget:
                continue
            state = _read(path, model)
            if state is None:
                if path.exists():  # (a model drafting for itself lists its files twice)
                    aside = path.with_suffix(".damaged")
                    os.replace(path, aside)
                    said = f"edgespec: the saved prompt state {path} does not verify; set aside as {aside.name}"
                    print(said, file=sys.stderr)
            elif len(state.tokens) < model.n_ctx:
                self.states.insert(0, state)  # older than what this run saves
                loaded += 1
        return loaded


def state_folder(model) -> Path:
    """Where `model`'s states are kept on disk: one folder per model file (path, size, time),
    llama.cpp build and flash-attention setting."""
    st = model.path.stat()
    identity = f"{build()}|{model.path.resolve()}:{st.st_size}:{st.st_mtime_ns}|fa={int(model.flash_attn)}"
    return cache_dir() / "prompts" / hashlib.sha256(identity.encode()).hexdigest()[:24]


def _write(path: Path, state: SavedState) -> None:
    """MAGIC, the header's length, the header (tokens, size and sha256 of the data), the data;
    written whole or not at all."""
    data = memoryview(state.data)
    header = json.dumps({"tokens": state.tokens, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})

    def write(f) -> None:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header.encode())
        f.write(data)

    replace_atomically(path, write)


def _read(path: Path, model) -> SavedState | None:
    """The state a file holds, or None where it does not verify."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 8)
            length = int.from_bytes(head[len(MAGIC) :], "little")
            if head[: len(MAGIC)] != MAGIC or length > MAX_HEADER:
                return None
            header = json.loads(f.read(length))
            size = header["size"]
            if size != path.stat().st_size - len(head) - length:  # the data, all of it and no more
                return None
            data = (ctypes.c_uint8 * size)()
            if f.readinto(data) != size:
                return None
        tokens = header["tokens"]
        valid = all(isinstance(t, int) and 0 <= t < model.n_vocab for t in tokens)
        if not valid or hashlib.sha256(data).hexdigest() != header["sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return None
    return SavedState(id(model), tokens, data)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
