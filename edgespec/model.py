"""A thin layer over llama.cpp's low-level API: one model, one context, its sequences.

`Model.tokens` always equals what the cache holds in the sequence in use (`use()`: a
context holds one per request answered at once, each with n_ctx cells of its own), so
callers reason about the cache as a token list: `sync()` keeps the longest common prefix with a new sequence,
`eval()` appends, `truncate()` drops the tail, exactly, whatever the architecture.

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
import itertools
import os
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import TypeVar

import llama_cpp
import llama_cpp.llama_cpp_ext as llama_ext
import numpy as np

from .errors import EdgespecError
from .kernels import choose_repack
from .prompt_cache import MIN_RESTORED, MIN_TOKENS, PromptCache, common_prefix, reusable_prefix
from .tokenizer import Tokenizer, check_gguf, load_gguf

KV_MEMORY_SHARE = 0.25  # a default context's KV caches (all models of an engine) take at most this share of memory
MIN_DEFAULT_CTX = 2048  # ... but never less than this many tokens
MAX_SNAPSHOTS = 64  # the longest draft a target verifies (a 64-token copy) is cut back by at most this much
SNAPSHOT_MEMORY_SHARE = 0.05  # llama.cpp's recurrent snapshots take at most this share of memory
PARTIAL_ONLY = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # a state's recurrent part alone
SNAPSHOT_PROBE = (1, 2, 3, 4)  # tokens of the snapshot probe (any ids: it compares logits, not text)
HIDDEN_MEMORY = 64 << 20  # bytes of hidden states a sequence keeps for MTP layers that have not read them
TREE_BRANCHES = 16  # a draft tree's branches a one-sequence attention context verifies in one pass, at most


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
    hidden: HiddenStates | None = None  # where the model exports them (Model.export_hidden), those not yet taken


@dataclass(frozen=True)
class TreePass:
    """A tree pass not yet settled (Model.keep): its nodes from position `at` on."""

    at: int
    first: list[int]  # the branch of first children, which the current sequence holds
    spares: list[int]  # the other branches' sequence ids
    hidden: np.ndarray | None  # where they are exported: the hidden states of its root and nodes, in node order


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


_uses = itertools.count(1)


@dataclass(eq=False)
class Pass:
    """A sequence's next tokens, decoded beside the other sequences' (Model.decode): then the
    logits of its last `rows` tokens (a view into llama.cpp's buffer, as eval's: valid until the
    model's next decode), or the error that stopped it. A pass of no tokens is a run waiting a
    step (for another to read the prompt they share, see Sequences.reading_ahead)."""

    seq: int
    tokens: list[int]
    rows: int | None = None  # None: the last token's row alone, shape (n_vocab,); else (rows, n_vocab)
    model: Model | None = None  # whose pass it is (the target's or the draft model's: Engine.decode)
    logits: np.ndarray | None = None
    error: Exception | None = None  # ContextFull, or a failed decode (EdgespecError)
    seconds: float = 0.0  # the decode it was part of
    beside: tuple[tuple[int, int], ...] = ()  # (seq, tokens) of the passes decoded with it
    # a tree of drafts after the tokens the cache lacks (Model.can_branch): the last len(parents)
    # tokens are its nodes, parents[i] node i's parent (-1: the token before the nodes); rows
    # then come for that token and every node; Model.keep() settles which branch stays
    parents: list[int] | None = None

    def result(self) -> np.ndarray:
        """The logits, or the error raised."""
        if self.error is not None:
            raise self.error
        return self.logits


T = TypeVar("T")


def decoded_alone(steps: Generator[Pass, None, T]) -> T:
    """What a generator of passes returns, each pass decoded alone as it comes."""
    while True:
        try:
            one = next(steps)
        except StopIteration as end:
            return end.value
        one.model.decode([one])


@dataclass(frozen=True)
class StateSizes:
    """What a context of this model keeps: bytes per token (attention) and per sequence (recurrent)."""

    per_token: int
    recurrent: int


class Model(Tokenizer):
    """A GGUF model with its own llama.cpp context, of n_seq sequences (one unless asked)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        n_batch: int = 512,
        flash_attn: bool = False,
        repack: bool | None = None,
        kv_memory_share: float = KV_MEMORY_SHARE,
        snapshots: int = MAX_SNAPSHOTS,
        n_seq: int = 1,
        load_mtp: bool = False,
    ) -> None:
        """n_ctx: context size in tokens; None: the model's trained context, or less if its
        KV cache would take more than kv_memory_share of this machine's memory.
        flash_attn: llama.cpp's flash attention, faster on some machines and slower on
        others (the loader chooses it by measurement, see calibration.py).
        repack: weights repacked into llama.cpp's extra buffer types (its default) or not
        (--no-repack); None: whichever works and runs faster here (see kernels.py: on
        some CPUs the repacked kernels crash).
        snapshots: on a recurrent or hybrid model, how many tokens a pass may be cut back by
        llama.cpp's snapshots (fewer if they would take more than SNAPSHOT_MEMORY_SHARE of
        memory; 0 where the architecture has none or they fail the probe); a draft model,
        which decodes one token a pass, has no use for them.
        n_seq: sequences the context holds (one per request answered at once, see use()), each
        with n_ctx cells of its own: llama.cpp's unified cache, where they share cells, computes
        other logits for a sequence once its neighbours' cells lie among its own (measured: up
        to 1.4 apart on SmolLM2-135M, with and without flash attention; llama.cpp issue 24962),
        and an answer's law must not depend on what runs beside it.
        load_mtp: its multi-token-prediction layers loaded too, for heads.Heads (llama.cpp skips them
        otherwise)."""
        self._ctx = self._batch = None
        self.path = check_gguf(path)
        self.n_threads = n_threads or os.cpu_count() or 1
        self.n_gpu_layers = n_gpu_layers
        if repack is None:
            repack = choose_repack(self.path, self.n_threads, n_gpu_layers)
        self.repack = repack
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers
        model_params.use_extra_bufts = repack
        model_params.load_mtp = load_mtp
        self._model = load_gguf(self.path, model_params)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_seq, self.seq = n_seq, 0  # seq: the sequence eval(), cut(), sync() work on (see use())
        self._sequences = [SequenceState() for _ in range(n_seq)]
        self._now = self._sequences[0]
        self._decodes = 0  # llama_decode calls so far, of all sequences
        self.prompt_cache: PromptCache | None = None  # saved states of other prompts (see prompt_cache.py)
        self.hidden_width = 0  # > 0: each decode's hidden states kept per sequence (export_hidden)
        self.recurrent = bool(
            llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model)
        )
        sizes = self._state_sizes(n_batch) if self.recurrent else None
        if n_ctx is None:
            n_ctx = self.default_context(kv_memory_share, sizes.per_token if sizes else self.kv_bytes_per_token)
        # a tree's branches are sequences of one unified cache, sharing the cells of what they share;
        # llama.cpp refuses such a batch where sequences have cells of their own (n_seq > 1) and on a
        # Mamba, and splits a hybrid's into one pass per branch (a tree could never beat its chain)
        self.branches = TREE_BRANCHES if n_seq == 1 and not self.recurrent else 0
        self._tree: TreePass | None = None
        self.n_snapshots = 0
        if sizes is not None and snapshots > 0:
            fit = int(SNAPSHOT_MEMORY_SHARE * physical_memory()) // max(sizes.recurrent * n_seq, 1)
            self.n_snapshots = min(snapshots, fit)
        self._make_context(n_ctx, n_batch, flash_attn)
        if self.n_snapshots and not self._snapshots_work():  # not for this architecture, or not exact here
            self.n_snapshots = 0
            self._free_context()
            self._make_context(n_ctx, n_batch, flash_attn)

    @property
    def tokens(self) -> list[int]:
        """What the cache holds in the current sequence."""
        return self._now.tokens

    @property
    def llama_model(self):
        """llama.cpp's model (for a second context on its weights: heads.py)."""
        return self._model

    def export_hidden(self) -> None:
        """From now on keep the hidden state of every position each decode writes, per sequence,
        until take_hidden() (for MTP layers, heads.py)."""
        self.hidden_width = llama_cpp.llama_model_n_embd_out(self._model)
        self._export_hidden()

    def _export_hidden(self) -> None:
        llama_ext.llama_set_embeddings_nextn(self._ctx, True, False)  # of every token, not only the output rows

    def take_hidden(self) -> HiddenStates | None:
        """The hidden states the current sequence's decodes kept since the last take (None: none)."""
        hidden, self._now.hidden = self._now.hidden, None
        return hidden

    def _keep_hidden(self, state: SequenceState, index: int, count: int) -> None:
        """After a decode: the hidden states of its tokens index..index+count-1, which the
        sequence holds at its last `count` positions."""
        if self.hidden_width:
            self._add_hidden(
                state, HiddenStates(len(state.tokens) - count, [self._hidden_rows(index + count)[index:].copy()])
            )

    def _hidden_rows(self, count: int) -> np.ndarray:
        """The hidden states of the last decode's first `count` tokens (a view into llama.cpp's
        buffer, valid until the next decode)."""
        states = llama_ext.llama_get_embeddings_nextn(self._ctx)
        if not states:
            raise EdgespecError(f"llama.cpp kept no hidden states of {self.path.name}; use --no-draft")
        return np.ctypeslib.as_array(states, shape=(count, self.hidden_width))

    @staticmethod
    def _add_hidden(state: SequenceState, newer: HiddenStates) -> None:
        state.hidden = newer if state.hidden is None else state.hidden.add(newer)

    def use(self, seq: int) -> None:
        """Work on sequence `seq` from now on (each request answered at once has its own)."""
        self.seq, self._now = seq, self._sequences[seq]
        self._now.last_used = next(_uses)

    def sequence_tokens(self, seq: int) -> list[int]:
        """What the cache holds in sequence `seq`."""
        return self._sequences[seq].tokens

    @property
    def cells_used(self) -> int:
        """Tokens all sequences hold (of their n_seq * n_ctx cells)."""
        return sum(len(s.tokens) for s in self._sequences)

    def last_used(self, seq: int) -> int:
        """When use() last chose sequence `seq` (0: never; larger: later)."""
        return self._sequences[seq].last_used

    @property
    def rollback(self) -> Rollback:
        if not self.recurrent:
            return Rollback.TRUNCATE
        return Rollback.SNAPSHOTS if self.n_snapshots else Rollback.CHECKPOINTS

    @property
    def can_branch(self) -> bool:
        """Whether a pass may carry a tree of drafts (Pass.parents): a one-sequence attention context."""
        return self.branches > 0

    def _make_context(self, n_ctx: int, n_batch: int, flash_attn: bool, *, n_snapshots: int | None = None) -> None:
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx * self.n_seq  # llama.cpp gives each sequence an equal share
        ctx_params.n_batch = ctx_params.n_ubatch = n_batch
        ctx_params.n_seq_max = self.n_seq + getattr(self, "branches", 0)  # (not yet set: _state_sizes)
        ctx_params.kv_unified = self.n_seq == 1  # else each sequence its own cells (see __init__)
        ctx_params.n_rs_seq = self.n_snapshots if n_snapshots is None else n_snapshots
        ctx_params.swa_full = True  # a sliding window's cache keeps every token, so a cut back stays exact
        ctx_params.n_threads = ctx_params.n_threads_batch = self.n_threads
        ctx_params.no_perf = True
        ctx_params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            self.close()
            raise EdgespecError(f"llama.cpp could not create a {n_ctx}-token context for {self.path}; lower --ctx")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        if self.hidden_width:  # (a context made again: set_flash_attn)
            self._export_hidden()
        if n_snapshots is None and self.n_snapshots:  # llama.cpp keeps none for architectures without them
            self.n_snapshots = min(self.n_snapshots, llama_cpp.llama_n_rs_seq(self._ctx))
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self._ctx)  # a sequence's (llama.cpp rounds it up to 256)
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)  # llama.cpp caps it at n_ctx
        self.flash_attn = flash_attn
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1 + getattr(self, "branches", 0))
        self._sequences = [SequenceState() for _ in range(self.n_seq)]
        self._now = self._sequences[self.seq]

    def set_flash_attn(self, flash_attn: bool) -> None:
        """Recreate the context with flash attention on or off (the cache starts empty)."""
        if flash_attn != self.flash_attn:
            if self.prompt_cache is not None:  # states of the old context may not fit the new one
                self.prompt_cache.drop(self)
            n_ctx, n_batch = self.n_ctx, self.n_batch
            self._free_context()
            self._make_context(n_ctx, n_batch, flash_attn)

    @property
    def n_ctx_train(self) -> int:
        """The context the model was trained with."""
        return llama_cpp.llama_model_n_ctx_train(self._model)

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token takes in the KV cache of a transformer: keys and values (f16) of every layer."""
        m = self._model
        head_dim = llama_cpp.llama_model_n_embd(m) // max(llama_cpp.llama_model_n_head(m), 1)
        return 2 * 2 * llama_cpp.llama_model_n_layer(m) * llama_cpp.llama_model_n_head_kv(m) * head_dim

    def default_context(self, memory_share: float = KV_MEMORY_SHARE, bytes_per_token: int | None = None) -> int:
        """The trained context, capped so that the KV cache (of all n_seq sequences) fits memory_share
        of this machine's memory (a purely recurrent model keeps nothing per token: its context is
        only a position limit)."""
        per_token = self.kv_bytes_per_token if bytes_per_token is None else bytes_per_token
        if per_token <= 0:
            return self.n_ctx_train
        fits = int(memory_share * physical_memory() / (per_token * self.n_seq)) // 256 * 256
        return max(min(self.n_ctx_train, fits), min(MIN_DEFAULT_CTX, self.n_ctx_train))

    def _state_sizes(self, n_batch: int) -> StateSizes:
        """Measured in a small context of its own (a hybrid's layers differ: the API has no per-layer
        head counts): the serialized state after 1 and after 9 tokens, and its recurrent part."""
        self._make_context(64, min(n_batch, 64), False, n_snapshots=0)
        try:
            self.eval([0])
            one = llama_cpp.llama_state_seq_get_size(self._ctx, self.seq)
            recurrent = llama_cpp.llama_state_seq_get_size_ext(self._ctx, self.seq, PARTIAL_ONLY)
            self.eval([0] * 8)
            nine = llama_cpp.llama_state_seq_get_size(self._ctx, self.seq)
        finally:
            self._free_context()
        return StateSizes(per_token=max(nine - one, 0) // 8, recurrent=recurrent)

    def _snapshots_work(self) -> bool:
        """Whether a pass cut back by llama.cpp's snapshots leaves the state a fresh run has: the
        next token's logits must agree (a wrong state changes them far more than batch noise)."""
        if not self.n_snapshots:
            return False
        head = list(SNAPSHOT_PROBE[:2])
        try:
            self.eval(list(SNAPSHOT_PROBE))
            if self.cut(len(head)) != len(head):  # refused: cut fell back to the empty cache
                return False
            cut = np.array(self.eval(head[-1:]))
            self._clear()
            self.eval(head)
            fresh = np.array(self.eval(head[-1:]))
        except EdgespecError:
            return False
        finally:
            self._clear()
        return bool(np.allclose(cut, fresh, rtol=1e-2, atol=1e-2 * float(np.abs(fresh).max())))

    # --- vocabulary -------------------------------------------------------
    # --- KV cache ---------------------------------------------------------
    def checkpoint(self, next_pass: int | None = None) -> None:
        """Make a later cut back to the current length exact and cheap. A recurrent state is
        copied out here, unless the next eval is one pass of `next_pass` tokens that llama.cpp's
        snapshots can cut back (next_pass None: several passes follow, as a draft model's)."""
        if not self.recurrent:
            return
        if next_pass is not None and next_pass - 1 <= self.n_snapshots:
            return
        if not self.tokens:  # the way back is the empty cache
            self._now.checkpoint = None
            return
        size = llama_cpp.llama_state_seq_get_size_ext(self._ctx, self.seq, PARTIAL_ONLY)
        old = self._now.checkpoint
        data = old.data if old is not None and len(old.data) == size else (ctypes.c_uint8 * size)()  # reused
        if llama_cpp.llama_state_seq_get_data_ext(self._ctx, data, size, self.seq, PARTIAL_ONLY) != size:
            raise EdgespecError(f"llama.cpp could not save the recurrent state of {self.path.name}; use --no-draft")
        self._now.checkpoint = Checkpoint(len(self.tokens), data)

    def truncate(self, n: int) -> None:
        """Drop cached tokens at positions >= n (on a recurrent model: cut back to a snapshot or
        checkpoint, then evaluate again what lies between it and n)."""
        if n < len(self.tokens):
            keep = self.tokens[:n]
            self.eval(keep[self.cut(n) :])

    def cut(self, n: int) -> int:
        """Cut the cache to at most n tokens, as close to n as this context can, without evaluating
        anything; returns the length kept (see the module docstring): the caller evaluates the rest,
        in its next pass."""
        if n >= len(self.tokens):
            return len(self.tokens)
        if not self.recurrent:
            self._check(llama_cpp.llama_memory_seq_rm(self._memory, self.seq, n, -1))
            self._drop_from(n)
            return n
        # a snapshot: only of the last pass (llama.cpp's other slots are stale), once per decode
        in_last_pass = len(self.tokens) - n <= min(self.n_snapshots, self._now.last_pass - 1)
        if (
            in_last_pass
            and self._now.last_decode == self._decodes  # no other sequence's pass came after
            and 0 < n
            and not self._now.snapshot_pending
            and llama_cpp.llama_memory_seq_rm(self._memory, self.seq, n, -1)
        ):
            self._now.snapshot_pending = True
            self._drop_from(n)
            return n
        point = self._now.checkpoint
        if point is not None and point.n_tokens <= n and self._restore(point):
            return point.n_tokens
        self._clear()  # the empty cache is always exact
        return 0

    def _restore(self, point: Checkpoint) -> bool:
        """The recurrent state back at the checkpoint, the attention tail after it dropped."""
        size = len(point.data)
        if llama_cpp.llama_state_seq_set_data_ext(self._ctx, point.data, size, self.seq, PARTIAL_ONLY) != size:
            return False
        if not llama_cpp.llama_memory_seq_rm(self._memory, self.seq, point.n_tokens, -1):
            return False
        self._now.snapshot_pending = False
        self._drop_from(point.n_tokens)
        return True

    def _drop_from(self, n: int) -> None:
        del self.tokens[n:]
        if self._now.checkpoint is not None and self._now.checkpoint.n_tokens > n:
            self._now.checkpoint = None
        if self._now.hidden is not None:
            self._now.hidden = self._now.hidden.cut(n)

    def _clear(self) -> None:
        if llama_cpp.llama_memory_seq_rm(self._memory, self.seq, 0, -1):
            self._sequences[self.seq] = self._now = SequenceState(last_used=self._now.last_used)
        else:  # llama.cpp refused: every sequence starts from nothing
            llama_cpp.llama_memory_clear(self._memory, True)
            self._sequences = [SequenceState() for _ in range(self.n_seq)]
            self._now = self._sequences[self.seq]

    def sync(self, tokens: list[int]) -> int:
        """Keep the longest cached prefix of `tokens` this context can cut back to, but never
        the last token, whose logits the caller needs from a fresh eval; with a prompt cache, a
        saved state that shares more of `tokens` is brought back (and the one that would be cut,
        kept); another sequence that holds more of them is copied in. Returns how many tokens
        were kept: the caller evaluates the rest."""
        n = self.shares(tokens)
        # a prompt of another conversation (a round discards fewer): keep what would be lost, bring back a better one
        if self.prompt_cache is not None and max(len(tokens) - 1, len(self.tokens)) - n >= MIN_TOKENS:
            n = self.prompt_cache.swap(self, tokens, n)
        return self.cut(self._copy_from_neighbour(tokens, n))

    def _copy_from_neighbour(self, tokens: list[int], kept: int) -> int:
        """Where another sequence holds MIN_RESTORED more of `tokens` than this one keeps (an
        agent's sub-agent, or its next turn while a side request runs, on the same long system
        prompt), its state copied in (milliseconds, where reading the prompt again takes minutes
        on a CPU); the tokens now shared. A recurrent state only where `tokens` continue all of it."""

        def reusable(seq: int) -> int:
            return reusable_prefix(self._sequences[seq].tokens, tokens, len(tokens) - 1, self.recurrent)

        best = max((i for i in range(self.n_seq) if i != self.seq), key=reusable, default=None)
        if best is None or (shared := reusable(best)) < kept + MIN_RESTORED:
            return kept
        data = self.save_state(best)
        if data is None or not self.restore_state(list(self._sequences[best].tokens), data):
            return self.shares(tokens)  # (restore_state leaves the sequence empty where llama.cpp refuses)
        return shared

    def shares(self, tokens: list[int]) -> int:
        """How many of `tokens` (all but the last) the cache holds already."""
        return common_prefix(self.tokens, tokens, len(tokens) - 1)  # called every round: compared in C

    def cached(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the caches hold: a live sequence, or a saved state (see prompt_cache.py)."""
        tokens = list(tokens)
        saved = self.prompt_cache.reusable(self, tokens) if self.prompt_cache is not None else 0
        return max(max(common_prefix(s.tokens, tokens, len(tokens)) for s in self._sequences), saved)

    def save_state(self, seq: int | None = None):
        """A sequence's contents (the one in use unless told) as llama.cpp serializes them, or None."""
        seq = self.seq if seq is None else seq
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        data = (ctypes.c_uint8 * size)()
        return data if llama_cpp.llama_state_seq_get_data(self._ctx, data, size, seq) == size else None

    def restore_state(self, tokens: list[int], data) -> bool:
        """Load a state from save_state() that holds `tokens`; False (cache empty) if llama.cpp refuses it."""
        self._clear()
        if llama_cpp.llama_state_seq_set_data(self._ctx, data, len(data), self.seq) != len(data):
            self._clear()
            return False
        self.tokens[:] = tokens
        return True

    def eval(self, tokens: list[int], *, rows: int | None = None) -> np.ndarray | None:
        """Append `tokens` to the cache in one forward pass (chunked by n_batch).

        Returns logits as a float32 view into llama.cpp's buffer, valid until the
        next eval: shape (rows, n_vocab), the rows of the last `rows` tokens (all in
        the last chunk), else the last token's row (n_vocab,). Returns None for an empty list."""
        if not tokens:
            return None
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextFull(self.n_ctx)
        last_chunk = len(tokens) - (len(tokens) - 1) // self.n_batch * self.n_batch  # (earlier chunks' rows are gone)
        if rows is not None and not 0 < rows <= last_chunk:
            raise ValueError(f"rows must be 1..{last_chunk} for {len(tokens)} tokens, got {rows}")
        first_row = len(tokens) - (rows or 1)  # the first token whose logits are made
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            self._batch.n_tokens = self._put(0, self.seq, len(self.tokens), chunk, first_row - start)
            status = llama_cpp.llama_decode(self._ctx, self._batch)
            self._now.snapshot_pending = False
            if status != 0:
                self._clear()  # what llama.cpp kept of a failed pass is not known: start again from nothing
                raise self._failure(status, len(chunk))
            self._decodes += 1
            self._now.last_pass, self._now.last_decode = len(chunk), self._decodes
            self.tokens.extend(chunk)
            self._keep_hidden(self._now, 0, len(chunk))
        if rows is not None:
            ptr = llama_cpp.llama_get_logits(self._ctx)
            return np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, -1), shape=(self.n_vocab,))

    def _eval_tree(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        """A pass over the cache's missing tokens and a tree of drafts after them (see Pass.parents),
        in one llama_decode: each branch (root to leaf) is a sequence, a token shared by several
        branches is one cell with all their ids, so every node attends to its own ancestors alone.
        Returns the rows of the last token before the nodes and of every node, in node order.
        The current sequence holds the branch of first children until keep() settles the pass."""
        n_nodes = len(parents)
        if any(not -1 <= parent < node for node, parent in enumerate(parents)):
            raise ValueError(f"a tree's parents must come before their children, got {parents}")
        if len(tokens) <= n_nodes:
            raise ValueError("a tree pass needs the token its root follows")
        head = tokens[: len(tokens) - n_nodes - 1]  # what comes before that token: a pass of its own
        if head:
            self.eval(head)
        root, nodes = tokens[len(tokens) - n_nodes - 1], tokens[len(tokens) - n_nodes :]
        children: list[list[int]] = [[] for _ in range(n_nodes + 1)]  # [parent + 1]
        for node, parent in enumerate(parents):
            children[parent + 1].append(node)
        leaves = [node for node in range(n_nodes) if not children[node + 1]]
        if len(leaves) > 1 + self.branches or 1 + n_nodes > self.n_batch:
            raise ValueError(f"a tree of {len(leaves)} branches and {n_nodes} nodes does not fit this context")
        if len(self.tokens) + 1 + n_nodes > self.n_ctx:
            raise ContextFull(self.n_ctx)
        first: list[int] = []  # the branch of first children: the current sequence holds it
        while children[(first[-1] if first else -1) + 1]:
            first.append(children[(first[-1] if first else -1) + 1][0])
        spares = list(range(self.n_seq, self.n_seq + len(leaves) - 1))
        holders: list[list[int]] = [[] for _ in range(n_nodes)]
        for leaf, seq in zip(
            [first[-1]] + [leaf for leaf in leaves if leaf != first[-1]], [self.seq, *spares], strict=True
        ):
            node = leaf
            while node >= 0:
                holders[node].append(seq)
                node = parents[node]
        for spare in spares:  # each branch starts as the sequence's copy (cells shared, not copied)
            self._check(llama_cpp.llama_memory_seq_rm(self._memory, spare, -1, -1))
            llama_cpp.llama_memory_seq_cp(self._memory, self.seq, spare, -1, -1)
        depth: list[int] = []  # a node's, below the root's children
        for parent in parents:
            depth.append(depth[parent] + 1 if parent >= 0 else 0)
        # the first branch's cells first: kept (see keep()), they follow the cache's with no gap
        # between, as a chain's would (cells out of order change the logits by up to 0.5 here)
        on_first = set(first)
        order = first + [node for node in range(n_nodes) if node not in on_first]
        at = len(self.tokens) + 1  # the first node's position
        batch = self._batch
        rows = [(root, at - 1, [self.seq, *spares])] + [(nodes[n], at + depth[n], holders[n]) for n in order]
        for i, (token, pos, seqs) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, len(seqs), True
            for j, seq in enumerate(seqs):
                batch.seq_id[i][j] = seq
        batch.n_tokens = 1 + n_nodes
        status = llama_cpp.llama_decode(self._ctx, batch)
        self._now.snapshot_pending = False
        if status != 0:
            for spare in spares:
                llama_cpp.llama_memory_seq_rm(self._memory, spare, -1, -1)
            self._clear()
            raise self._failure(status, 1 + n_nodes)
        self._decodes += 1
        self._now.last_pass, self._now.last_decode = 1 + n_nodes, self._decodes
        self.tokens.append(root)
        self.tokens.extend(nodes[node] for node in first)
        in_node_order = np.argsort([-1, *order]) if n_nodes else [0]
        hidden = self._hidden_rows(1 + n_nodes)[in_node_order] if self.hidden_width else None
        self._tree = TreePass(at, first, spares, hidden)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx), shape=(1 + n_nodes, self.n_vocab))
        return logits[in_node_order]

    def keep(self, path: list[int]) -> None:
        """Settle the last tree pass, whose nodes `path` (root first) the target took: the other
        branches are removed, and the sequence keeps as much of the path as its first-children
        branch shares (the rest, on another branch, is read again by the next pass: kept where it
        was written, its cells would lie out of order). The hidden states of the root and the
        whole path are kept (each node's is its own branch's): MTP heads read them at once."""
        tree, self._tree = self._tree, None
        if tree is None:
            raise ValueError("keep() follows a tree pass")
        kept = common_prefix(tree.first, path, len(path))
        self._check(llama_cpp.llama_memory_seq_rm(self._memory, self.seq, tree.at + kept, -1))
        for spare in tree.spares:
            self._check(llama_cpp.llama_memory_seq_rm(self._memory, spare, -1, -1))
        self._drop_from(tree.at + kept)
        if tree.hidden is not None:  # (the path's rows past the cache are replaced when it reads them again)
            self._add_hidden(self._now, HiddenStates(tree.at - 1, [tree.hidden[[0, *(node + 1 for node in path)]]]))

    def _check(self, done: bool) -> None:
        if not done:
            raise EdgespecError(f"llama.cpp refused to cut the cache of {self.path.name}; report this as a bug")

    def _put(self, at: int, seq: int, pos0: int, tokens: list[int], first_row: int) -> int:
        """Sequence `seq`'s tokens (from position pos0) into the batch from index `at`, logits made
        for those from first_row on; returns the next index."""
        batch = self._batch
        for i, token in enumerate(tokens, start=at):
            batch.token[i] = token
            batch.pos[i] = pos0 + i - at
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i - at >= first_row
        return at + len(tokens)

    def _failure(self, status: int, n_tokens: int) -> Exception:
        """What a refused llama_decode of n_tokens tokens means for the caller."""
        if status == 1:  # no room for the batch in the cache
            return ContextFull(self.n_ctx)
        return EdgespecError(
            f"llama.cpp failed to evaluate {n_tokens} tokens with {self.path.name} (status {status});"
            " rerun with EDGESPEC_VERBOSE=1 to see llama.cpp's reason"
        )

    def decode(self, passes: list[Pass]) -> None:
        """Each pass's tokens appended to its sequence, as few llama_decode calls as fit n_batch
        (one where they do): every sequence's next rows read the weights once. Fills each pass's
        logits, or its error. A recurrent model decodes each pass alone (its snapshots
        are of the last pass), as does a pass longer than n_batch (eval chunks it)."""
        groups: list[list[Pass]] = []
        # llama.cpp batches consecutive sequences together
        for one in sorted((p for p in passes if p.tokens), key=lambda p: p.seq):
            fits = groups and sum(len(p.tokens) for p in groups[-1]) + len(one.tokens) <= self.n_batch
            if fits and not self.recurrent and one.parents is None and groups[-1][0].parents is None:
                groups[-1].append(one)
            else:
                groups.append([one])
        current = self.seq
        for group in groups:
            if len(group) == 1:
                self._decode_alone(group[0])
            else:
                self._decode_together(group)
        self.use(current)

    def _decode_alone(self, one: Pass) -> None:
        self.use(one.seq)
        start = perf_counter()
        try:
            if one.parents is None:
                one.logits = self.eval(one.tokens, rows=one.rows)
            else:
                one.logits = self._eval_tree(one.tokens, one.parents)
        except (ContextFull, EdgespecError) as e:
            one.error = e
        one.seconds, one.beside = perf_counter() - start, ()

    def _decode_together(self, group: list[Pass]) -> None:
        """One llama_decode for the group (its tokens fit n_batch)."""
        ok, at = [], 0
        for one in group:
            state = self._sequences[one.seq]
            if len(state.tokens) + len(one.tokens) > self.n_ctx:
                one.error = ContextFull(self.n_ctx)
                continue
            if one.rows is not None and not 0 < one.rows <= len(one.tokens):
                raise ValueError(f"rows must be 1..{len(one.tokens)} for {len(one.tokens)} tokens, got {one.rows}")
            at = self._put(at, one.seq, len(state.tokens), one.tokens, len(one.tokens) - (one.rows or 1))
            ok.append(one)
        if not ok:
            return
        self._batch.n_tokens = at
        start = perf_counter()
        status = llama_cpp.llama_decode(self._ctx, self._batch)
        seconds = perf_counter() - start
        self._decodes += 1
        if status != 0:
            for one in ok:  # what llama.cpp kept of a failed pass is not known: each starts again from nothing
                self.use(one.seq)
                self._clear()
                one.error = self._failure(status, at)
            return
        rows = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits(self._ctx), shape=(sum(p.rows or 1 for p in ok), self.n_vocab)
        )
        row = index = 0
        for one in ok:
            state = self._sequences[one.seq]
            n = one.rows or 1
            one.logits = rows[row : row + n] if one.rows is not None else rows[row]
            row += n
            state.tokens.extend(one.tokens)
            self._keep_hidden(state, index, len(one.tokens))
            index += len(one.tokens)
            state.snapshot_pending = False
            state.last_pass, state.last_decode = len(one.tokens), self._decodes
            one.seconds = seconds
            one.beside = tuple((p.seq, len(p.tokens)) for p in ok if p is not one)

    # --- lifetime ---------------------------------------------------------
    def _free_context(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def close(self) -> None:
        self._free_context()
        super().close()


def physical_memory() -> int:
    """Bytes of memory this machine has (8 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class ContextFull(Exception):
    """The sequence no longer fits in the context window."""

    def __init__(self, n_ctx: int) -> None:
        super().__init__(f"context full ({n_ctx} tokens)")
        self.n_ctx = n_ctx
