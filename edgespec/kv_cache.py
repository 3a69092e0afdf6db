"""The cache of a model's sequences, cut back exactly whatever the architecture.

`Model.tokens` always equals what the cache holds in the sequence in use, so callers reason about
the cache as a token list: `sync()` keeps the longest common prefix with a new sequence,
`Model.eval()` appends, `truncate()` drops the tail, exactly.

Attention caches keep one entry per token, so any tail can be dropped
(llama_memory_seq_rm). Recurrent layers (Mamba, RWKV; and those of hybrids such as
Qwen3.5, Granite 4-H, LFM2, Jamba, Nemotron-H) keep one running state, which llama.cpp
cannot cut back, so the way back is chosen per context (Rollback):
- SNAPSHOTS: llama.cpp keeps the state after each of the last n_rs_seq tokens of a
  pass (llama_context_params.n_rs_seq, for some architectures), so a pass can be cut
  back by up to that many tokens; probed at load, its logits compared with a fresh run.
- CHECKPOINTS: elsewhere, `checkpoint()` copies the recurrent part of the state out
  before a pass that may be cut back (llama_state_seq_get_data_ext, PARTIAL_ONLY); a cut
  restores it, drops the attention tail and evaluates the kept tokens after it again.
A cut that none of these covers starts from an empty cache. A refused removal, restore
or decode is never ignored: the model recovers exactly or raises EdgespecError.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from .errors import EdgespecError, EngineFault
from .hidden_states import HiddenStates
from .prompt_cache import MIN_RESTORED, MIN_TOKENS, common_prefix, reusable_prefix

PARTIAL_ONLY = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # a state's recurrent part alone
SNAPSHOT_PROBE = (1, 2, 3, 4)  # tokens of the snapshot probe (any ids: it compares logits, not text)


class Rollback(enum.Enum):
    """How a context's cache is cut back to an earlier length (see the module docstring)."""

    TRUNCATE = "truncate"  # attention only: any tail is dropped
    SNAPSHOTS = "snapshots"  # recurrent state: llama.cpp's per-token snapshots of the last pass, else checkpoints
    CHECKPOINTS = "checkpoints"  # recurrent state: saved before a pass, restored, the kept tokens evaluated again


@dataclass
class Checkpoint:
    """The recurrent part of the state after the first n_tokens tokens."""

    n_tokens: int
    data: ctypes.Array


@dataclass
class SequenceState:
    """One sequence of a context: what its cache holds and its ways back."""

    tokens: list[int] = field(default_factory=list)
    checkpoint: Checkpoint | None = None
    last_pass: int = 0  # tokens in its last llama_decode: llama.cpp's snapshots cover only that pass
    last_decode: int = 0  # which of the context's decodes that was (the snapshots are the last decode's)
    snapshot_pending: bool = False  # a snapshot rollback is used once, by the next decode
    last_used: int = 0  # when use() last chose it (of the free ones, the least recently used is taken first)
    hidden: HiddenStates | None = None  # where the model exports them (HiddenExport.export), those not yet taken

    def keep_hidden(self, newer: HiddenStates | None) -> None:
        """`newer` (if any) added to the hidden states the sequence keeps."""
        if newer is not None:
            self.hidden = newer if self.hidden is None else self.hidden.add(newer)


class Cache:
    """The cache of a Model's sequence in use (Model.use): its ways back, a tree pass settled,
    its state saved and restored. `model` is the Model whose context it is (its sequences,
    llama.cpp's handles, and eval for what a cut must read again)."""

    def __init__(self, model) -> None:
        self.model = model
        self.reuse = 0  # llama-server's --cache-reuse: cached runs of this many tokens at least are shifted (0: none)

    @property
    def rollback(self) -> Rollback:
        if not self.model.recurrent:
            return Rollback.TRUNCATE
        return Rollback.SNAPSHOTS if self.model.n_snapshots else Rollback.CHECKPOINTS

    def snapshots_work(self) -> bool:
        """Whether a pass cut back by llama.cpp's snapshots leaves the state a fresh run has: the
        next token's logits must agree (a wrong state changes them far more than batch noise)."""
        if not self.model.n_snapshots:
            return False
        head = list(SNAPSHOT_PROBE[:2])
        try:
            self.model.eval(list(SNAPSHOT_PROBE))
            if self.cut(len(head)) != len(head):  # refused: cut fell back to the empty cache
                return False
            cut = np.array(self.model.eval(head[-1:]))
            self.clear()
            self.model.eval(head)
            fresh = np.array(self.model.eval(head[-1:]))
        except EdgespecError:
            return False
        finally:
            self.clear()
        return bool(np.allclose(cut, fresh, rtol=1e-2, atol=1e-2 * float(np.abs(fresh).max())))

    def checkpoint(self, next_pass: int | None = None) -> None:
        """Make a later cut back to the current length exact and cheap. A recurrent state is
        copied out here, unless the next eval is one pass of `next_pass` tokens that llama.cpp's
        snapshots can cut back (next_pass None: several passes follow, as a draft model's)."""
        if not self.model.recurrent:
            return
        if next_pass is not None and next_pass - 1 <= self.model.n_snapshots:
            return
        if not self.model.tokens:  # the way back is the empty cache
            self.model.state.checkpoint = None
            return
        size = llama_cpp.llama_state_seq_get_size_ext(self.model.llama_context, self.model.seq, PARTIAL_ONLY)
        old = self.model.state.checkpoint
        data = old.data if old is not None and len(old.data) == size else (ctypes.c_uint8 * size)()  # reused
        if (
            llama_cpp.llama_state_seq_get_data_ext(self.model.llama_context, data, size, self.model.seq, PARTIAL_ONLY)
            != size
        ):
            raise EngineFault(f"llama.cpp could not save the recurrent state of {self.model.path.name}; use --no-draft")
        self.model.state.checkpoint = Checkpoint(len(self.model.tokens), data)

    def truncate(self, n: int) -> None:
        """Drop cached tokens at positions >= n (on a recurrent model: cut back to a snapshot or
        checkpoint, then evaluate again what lies between it and n)."""
        if n < len(self.model.tokens):
            keep = self.model.tokens[:n]
            self.model.eval(keep[self.cut(n) :])

    def cut(self, n: int) -> int:
        """Cut the cache to at most n tokens, as close to n as this context can, without evaluating
        anything; returns the length kept (see the module docstring): the caller evaluates the rest,
        in its next pass."""
        if n >= len(self.model.tokens):
            return len(self.model.tokens)
        if not self.model.recurrent:
            self.check(llama_cpp.llama_memory_seq_rm(self.model.llama_memory, self.model.seq, n, -1))
            self.drop_from(n)
            return n
        # a snapshot: only of the last pass (llama.cpp's other slots are stale), once per decode
        in_last_pass = len(self.model.tokens) - n <= min(self.model.n_snapshots, self.model.state.last_pass - 1)
        if (
            in_last_pass
            and self.model.state.last_decode == self.model.decodes  # no other sequence's pass came after
            and 0 < n
            and not self.model.state.snapshot_pending
            and llama_cpp.llama_memory_seq_rm(self.model.llama_memory, self.model.seq, n, -1)
        ):
            self.model.state.snapshot_pending = True
            self.drop_from(n)
            return n
        point = self.model.state.checkpoint
        if point is not None and point.n_tokens <= n and self._restore(point):
            return point.n_tokens
        self.clear()  # the empty cache is always exact
        return 0

    def _restore(self, point: Checkpoint) -> bool:
        """The recurrent state back at the checkpoint, the attention tail after it dropped."""
        size = len(point.data)
        if (
            llama_cpp.llama_state_seq_set_data_ext(
                self.model.llama_context, point.data, size, self.model.seq, PARTIAL_ONLY
            )
            != size
        ):
            return False
        if not llama_cpp.llama_memory_seq_rm(self.model.llama_memory, self.model.seq, point.n_tokens, -1):
            return False
        self.model.state.snapshot_pending = False
        self.drop_from(point.n_tokens)
        return True

    def drop_from(self, n: int) -> None:
        del self.model.tokens[n:]
        if self.model.state.checkpoint is not None and self.model.state.checkpoint.n_tokens > n:
            self.model.state.checkpoint = None
        if self.model.state.hidden is not None:
            self.model.state.hidden = self.model.state.hidden.cut(n)

    def clear(self) -> None:
        if llama_cpp.llama_memory_seq_rm(self.model.llama_memory, self.model.seq, 0, -1):
            self.model.states[self.model.seq] = self.model.state = SequenceState(last_used=self.model.state.last_used)
        else:  # llama.cpp refused: every sequence starts from nothing
            llama_cpp.llama_memory_clear(self.model.llama_memory, True)
            self.model.states = [SequenceState() for _ in range(self.model.n_seq)]
            self.model.state = self.model.states[self.model.seq]

    def sync(self, tokens: list[int], *, prompt: bool = False) -> int:
        """Keep the longest cached prefix of `tokens` this context can cut back to, but never
        the last token, whose logits the caller needs from a fresh eval; with a prompt cache, a
        saved state that shares more of `tokens` is brought back (and the one that would be cut,
        kept); another sequence that holds more of them is copied in; a prompt's read (`prompt`)
        with cache reuse on also keeps the runs of it cached after what changed (shift_runs).
        Returns how many tokens were kept: the caller evaluates the rest."""
        n = self.shares(tokens)
        # a prompt of another conversation (a round discards fewer): keep what would be lost, bring back a better one
        if self.model.prompt_cache is not None and max(len(tokens) - 1, len(self.model.tokens)) - n >= MIN_TOKENS:
            n = self.model.prompt_cache.swap(self.model, tokens, n)
        n = self._copy_from_neighbour(tokens, n)
        if prompt and self.reuse and len(self.model.tokens) - n >= self.reuse:
            n = self.shift_runs(tokens, n)
        return self.cut(n)

    def shift_runs(self, tokens: list[int], kept: int) -> int:
        """llama-server's --cache-reuse: past the first `kept` tokens, each cached run of at least
        `reuse` tokens that `tokens` (all but the last) go on with is moved to where they have it
        (llama_memory_seq_add shifts its positions, RoPE'd keys rotated along), the cells before it
        removed, so that an editor's snippets after the one its ring dropped stay read. Not what a
        fresh read computes: the moved cells were read after what was dropped (hence opt-in).
        Returns how many tokens the cache now shares with `tokens`."""
        held = np.asarray(self.model.tokens, dtype=np.int32).tobytes()
        limit = len(tokens) - 1
        at_prompt = at_cache = kept
        while at_prompt + self.reuse <= limit:
            needle = np.asarray(tokens[at_prompt : at_prompt + self.reuse], dtype=np.int32).tobytes()
            found = held.find(needle, 4 * at_cache)
            while found > 0 and found % 4:  # (a match across token boundaries)
                found = held.find(needle, found + 1)
            if found < 0:
                break
            run_at, n = found // 4, self.reuse
            run = n + common_prefix(self.model.tokens[run_at + n :], tokens[at_prompt + n :], limit - at_prompt - n)
            self.check(llama_cpp.llama_memory_seq_rm(self.model.llama_memory, self.model.seq, at_prompt, run_at))
            llama_cpp.llama_memory_seq_add(
                self.model.llama_memory, self.model.seq, run_at, run_at + run, at_prompt - run_at
            )
            at_prompt, at_cache = at_prompt + run, run_at + run
        if at_prompt > kept:
            self.check(llama_cpp.llama_memory_seq_rm(self.model.llama_memory, self.model.seq, at_prompt, -1))
            self.drop_from(kept)
            self.model.tokens.extend(tokens[kept:at_prompt])
        return at_prompt

    def _copy_from_neighbour(self, tokens: list[int], kept: int) -> int:
        """Where another sequence holds MIN_RESTORED more of `tokens` than this one keeps (an
        agent's sub-agent, or its next turn while a side request runs, on the same long system
        prompt), its state copied in (milliseconds, where reading the prompt again takes minutes
        on a CPU); the tokens now shared. A recurrent state only where `tokens` continue all of it."""

        def reusable(seq: int) -> int:
            return reusable_prefix(self.model.states[seq].tokens, tokens, len(tokens) - 1, self.model.recurrent)

        best = max((i for i in range(self.model.n_seq) if i != self.model.seq), key=reusable, default=None)
        if best is None or (shared := reusable(best)) < kept + MIN_RESTORED:
            return kept
        data = self.save_state(best)
        if data is None or not self.restore_state(list(self.model.states[best].tokens), data):
            return self.shares(tokens)  # (restore_state leaves the sequence empty where llama.cpp refuses)
        return shared

    def shares(self, tokens: list[int]) -> int:
        """How many of `tokens` (all but the last) the cache holds already."""
        return common_prefix(self.model.tokens, tokens, len(tokens) - 1)  # called every round: compared in C

    def cached(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the caches hold: a live sequence, or a saved state (see prompt_cache.py)."""
        tokens = list(tokens)
        saved = self.model.prompt_cache.reusable(self.model, tokens) if self.model.prompt_cache is not None else 0
        return max(max(common_prefix(s.tokens, tokens, len(tokens)) for s in self.model.states), saved)

    def save_state(self, seq: int | None = None):
        """A sequence's contents (the one in use unless told) as llama.cpp serializes them, or None."""
        seq = self.model.seq if seq is None else seq
        size = llama_cpp.llama_state_seq_get_size(self.model.llama_context, seq)
        data = (ctypes.c_uint8 * size)()
        return data if llama_cpp.llama_state_seq_get_data(self.model.llama_context, data, size, seq) == size else None

    def restore_state(self, tokens: list[int], data) -> bool:
        """Load a state from save_state() that holds `tokens`; False (cache empty) if llama.cpp refuses it."""
        self.clear()
        if llama_cpp.llama_state_seq_set_data(self.model.llama_context, data, len(data), self.model.seq) != len(data):
            self.clear()
            return False
        self.model.tokens[:] = tokens
        return True

    def keep(self, path: list[int]) -> None:
        """Settle the last tree pass, whose nodes `path` (root first) the target took: the other
        branches are removed, and the sequence keeps as much of the path as its first-children
        branch shares (the rest, on another branch, is read again by the next pass: kept where it
        was written, its cells would lie out of order). The hidden states of the root and the
        whole path are kept (each node's is its own branch's): MTP heads read them at once."""
        tree, self.model.tree = self.model.tree, None
        if tree is None:
            raise ValueError("keep() follows a tree pass")
        kept = common_prefix(tree.first, path, len(path))
        self.check(llama_cpp.llama_memory_seq_rm(self.model.llama_memory, self.model.seq, tree.at + kept, -1))
        for spare in tree.spares:
            self.check(llama_cpp.llama_memory_seq_rm(self.model.llama_memory, spare, -1, -1))
        self.drop_from(tree.at + kept)
        if tree.hidden is not None:  # (the path's rows past the cache are replaced when it reads them again)
            path_rows = tree.hidden[[0, *(node + 1 for node in path)]]
            self.model.state.keep_hidden(HiddenStates(tree.at - 1, [path_rows]))

    def check(self, done: bool) -> None:
        if not done:
            raise EngineFault(f"llama.cpp refused to cut the cache of {self.model.path.name}; report this as a bug")
