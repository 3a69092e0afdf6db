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

A state stays in RAM only while it may be wanted again at once: idle for SPILL_AFTER_S, the
engine writes it to disk (spill, a step of its idle work) and reads it back from there when a
prompt wants it, through the system's file cache, which gives the memory back when others need
it: a server's memory returns to its models and caches after each burst of requests, whatever
the budget (a 1.5B pair's server held 3.2 GiB with 17 states it had loaded, 2.8 GiB without).
The files outlive the run (save_to_disk writes the rest when it stops, load_from_disk takes in
their tokens when it starts): an agent's first request of the day (Claude Code's 20k-token
system prompt and tools) then costs what its second does. A state is valid only for the model
file, llama.cpp build, cache types and flash-attention setting it came from, so each has a folder
of its own; every file carries its tokens and the sha256 of its data, checked whenever it is
read; one that does not verify is set aside as NAME.damaged, said in one line.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
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
# a state unused this long is written to disk when the engine is idle (a 2,000-token state of
# Qwen2.5-1.5B, 56 MB: 0.3 s to write, 0.1 s to read back and check, on that EPYC)
SPILL_AFTER_S = 10.0
MAGIC = b"edgespec prompt state 1\n"
MAX_HEADER = 64 << 20  # bytes of a file's header (its tokens as JSON)


@dataclass
class SavedState:
    owner: int  # id() of the model whose context it came from
    tokens: list[int]  # what it holds
    size: int  # bytes of llama.cpp's serialized sequence
    folder: Path  # its model's folder on disk (state_folder)
    data: Any = None  # the serialized sequence (a ctypes byte array) while in RAM; None once on disk
    used_at: float = field(default_factory=time.monotonic)

    @property
    def path(self) -> Path:
        return self.folder / f"{hashlib.sha256(repr(self.tokens).encode()).hexdigest()[:24]}.state"


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

    @property
    def in_ram(self) -> int:
        """Bytes of the states not yet written to disk."""
        return sum(s.size for s in self.states if s.data is not None)

    def swap(self, model, tokens: list[int], kept: int) -> int:
        """Before `model`'s cache is cut to its first `kept` tokens to evaluate `tokens`
        (all but the last, whose logits the caller needs): keep what would be lost, and
        bring back a saved state that shares more of `tokens`. Returns the tokens the
        model's cache now shares with `tokens`."""
        best, reuse = self._best(model, tokens, len(tokens) - 1)
        data = None
        if best is not None and reuse >= kept + MIN_RESTORED:
            self._touch(best)  # the most recently used: what keeping the live state pushes out goes first
            data = self._data(best)
        if len(model.tokens) - kept >= MIN_TOKENS:
            self.keep(model)
        if data is not None and model.cache.restore_state(best.tokens, data):
            return reuse
        return common_prefix(model.tokens, tokens, kept)  # (kept, unless llama.cpp refused the state: then 0)

    def reusable(self, model, tokens: list[int]) -> int:
        """How many of `tokens` the best of `model`'s saved states holds (nothing is moved)."""
        return self._best(model, tokens, len(tokens))[1]

    def _best(self, model, tokens: list[int], limit: int) -> tuple[SavedState | None, int]:
        """The saved state of `model` that shares most of `tokens` (at most `limit`), and how many."""

        def reusable(state: SavedState) -> int:
            return reusable_prefix(state.tokens, tokens, limit, model.recurrent)

        best = max((s for s in self.states if s.owner == id(model)), key=reusable, default=None)
        return best, reusable(best) if best else 0

    def _touch(self, state: SavedState) -> None:
        state.used_at = time.monotonic()
        self.states = [s for s in self.states if s is not state] + [state]

    def _data(self, state: SavedState):
        """A state's data: in RAM, or read from its file and checked; None (the state forgotten,
        a damaged file set aside and said) where the file is gone or does not verify."""
        if state.data is not None:
            return state.data
        read = _read(state.path, n_vocab=None)
        if read is not None and read.tokens == state.tokens and read.size == state.size:
            return read.data
        set_aside(state.path)
        self._forget(state)
        return None

    def drop(self, model) -> None:
        """Forget `model`'s states (its context was made anew, or the engine forgets its prompts)."""
        for state in [s for s in self.states if s.owner == id(model)]:
            self._forget(state)

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
        for superseded in [s for s in mine if tokens[: len(s.tokens)] == s.tokens]:  # the new one continues it
            self._forget(superseded)
        self.states.append(SavedState(id(model), tokens, len(data), state_folder(model), data=data))
        self._fit()

    def _fit(self) -> None:
        """The least recently used states out, until the rest fit the budget."""
        while self.size > self.budget:
            self._forget(self.states[0])

    def _forget(self, state: SavedState) -> None:
        """A state out of the cache, and its file off the disk."""
        self.states = [s for s in self.states if s is not state]
        if state.data is None:
            state.path.unlink(missing_ok=True)

    # --- on disk --------------------------------------------------------------------------
    def spill(self, idle_for: float | None = None) -> bool:
        """Write the least recently used state that has been in RAM unused for `idle_for` seconds
        (None: SPILL_AFTER_S) to disk, and let its RAM go (idle work: one state a step); False
        where there is none."""
        idle_for, now = SPILL_AFTER_S if idle_for is None else idle_for, time.monotonic()
        state = next((s for s in self.states if s.data is not None and now - s.used_at >= idle_for), None)
        if state is None:
            return False
        with locked(f"prompts-{state.folder.name}", None):
            state.folder.mkdir(parents=True, exist_ok=True)
            if not state.path.exists():  # the same tokens of the same model file: the same state
                _write(state.path, state)
        state.data = None
        return True

    def spill_due(self) -> float | None:
        """Seconds until spill() has a state to write (0 where it has one now); None: none in RAM."""
        held = [s.used_at for s in self.states if s.data is not None]
        return max(0.0, min(held) + SPILL_AFTER_S - time.monotonic()) if held else None

    def save_to_disk(self, models) -> int:
        """Write the saved states, each model's live one first among them, to disk (most recent
        first, within the budget), replacing what the models' folders held. Returns bytes kept."""
        for model in models:
            for seq in range(model.n_seq):
                model.use(seq)
                if len(model.tokens) >= MIN_TOKENS:
                    self.keep(model)
        while self.spill(idle_for=0):
            pass
        stamp = time.time()
        for rank, state in enumerate(reversed(self.states)):
            try:
                os.utime(state.path, (stamp - rank, stamp - rank))  # newest first when loaded
            except OSError:  # (another process pruned it)
                self._forget(state)
        for folder in {state_folder(model) for model in models}:
            kept = {s.path for s in self.states}
            with locked(f"prompts-{folder.name}", None):
                for old in folder.glob("*.state"):
                    if old not in kept:
                        old.unlink(missing_ok=True)
        return self.size

    def load_from_disk(self, models) -> int:
        """Take in the tokens of the states save_to_disk kept for these models (most recent first,
        within the budget; each file's data is read and checked when a prompt wants it); a file
        that cannot be read (a disk that lost part of a write, a copy cut short) is set aside as
        NAME.damaged, said in one line, the others taken. Returns how many were taken."""
        files = [(path, model) for model in models for path in state_folder(model).glob("*.state")]
        files.sort(key=lambda found: _mtime(found[0]), reverse=True)
        loaded = 0
        for path, model in files:
            if self.size + _size(path) > self.budget:
                continue
            header = _read(path, n_vocab=model.n_vocab, data=False)
            if header is None:
                set_aside(path)
            elif len(header.tokens) < model.n_ctx:
                state = SavedState(id(model), header.tokens, header.size, path.parent, used_at=0.0)
                self.states.insert(0, state)  # older than what this run saves
                loaded += 1
        return loaded


@dataclass
class StateFile:
    tokens: list[int]
    size: int  # bytes of data
    data: Any = None  # (not read: a header alone)


def state_folder(model) -> Path:
    """Where `model`'s states are kept on disk: one folder per model file (path, size, time),
    llama.cpp build, cache types and flash-attention setting."""
    st = model.path.stat()
    identity = f"{build()}|{model.path.resolve()}:{st.st_size}:{st.st_mtime_ns}|fa={int(model.flash_attn)}"
    if model.compact_cache:  # (the folders of f16 caches keep the names they had)
        identity += f"|kv={model.cache_types}"
    return cache_dir() / "prompts" / hashlib.sha256(identity.encode()).hexdigest()[:24]


def set_aside(path: Path) -> None:
    """A file that does not verify renamed NAME.damaged, said in one line (unless it is gone)."""
    aside = path.with_suffix(".damaged")
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # (another process pruned it, or a model drafting for itself listed it twice)
        return
    print(f"edgespec: the saved prompt state {path} does not verify; set aside as {aside.name}", file=sys.stderr)


def _write(path: Path, state: SavedState) -> None:
    """MAGIC, the header's length, the header (tokens, size and sha256 of the data), the data;
    written whole or not at all."""
    data = memoryview(state.data)
    header = json.dumps({"tokens": state.tokens, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})

    def write(f) -> None:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header.encode())
        f.write(data)

    replace_atomically(path, write)


def _read(path: Path, n_vocab: int | None, data: bool = True) -> StateFile | None:
    """What a file holds (its header alone unless `data`), or None where it does not verify: its
    tokens within n_vocab (None: checked when its header was), its data all there and, where read,
    matching its sha256."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 8)
            length = int.from_bytes(head[len(MAGIC) :], "little")
            if head[: len(MAGIC)] != MAGIC or length > MAX_HEADER:
                return None
            header = json.loads(f.read(length))
            size, tokens = header["size"], header["tokens"]
            if size != path.stat().st_size - len(head) - length:  # the data, all of it and no more
                return None
            if n_vocab is not None and not all(isinstance(t, int) and 0 <= t < n_vocab for t in tokens):
                return None
            if not data:
                return StateFile(tokens, size)
            buffer = (ctypes.c_uint8 * size)()
            if f.readinto(buffer) != size or hashlib.sha256(buffer).hexdigest() != header["sha256"]:
                return None
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return None
    return StateFile(tokens, size, buffer)


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
