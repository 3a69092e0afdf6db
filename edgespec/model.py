"""A thin layer over llama.cpp's low-level API: one model, one context, its sequences.

A context holds one sequence per request answered at once (`use()`), each with n_ctx cells of
its own; `Model.tokens` always equals what the cache holds in the sequence in use. `eval()`
appends tokens in one forward pass, `decode()` the passes of several sequences in as few
llama_decode calls as fit (passes.py); the cache is cut back, saved and restored through
`Model.cache` (kv_cache.py), and a target's hidden states kept for MTP layers through
`Model.hidden` (hidden_states.py). A refused removal, restore or decode is never ignored:
the model recovers exactly or raises EdgespecError.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from time import perf_counter

import llama_cpp
import numpy as np

from .errors import EdgespecError, EngineFault
from .hidden_states import HiddenExport
from .kernels import choose_repack
from .kv_cache import PARTIAL_ONLY, Cache, SequenceState
from .passes import ContextFull, Pass, TreePass
from .prompt_cache import PromptCache
from .tokenizer import Tokenizer, check_gguf, load_gguf

KV_MEMORY_SHARE = 0.25  # a default context's KV caches (all models of an engine) take at most this share of memory
MIN_DEFAULT_CTX = 2048  # ... but never less than this many tokens
MAX_SNAPSHOTS = 64  # the longest draft a target verifies (a 64-token copy) is cut back by at most this much
SNAPSHOT_MEMORY_SHARE = 0.05  # llama.cpp's recurrent snapshots take at most this share of memory
TREE_BRANCHES = 16  # a draft tree's branches a one-sequence attention context verifies in one pass, at most
# tokens a llama_decode reads at most: its compute buffers grow with it. On a CPU 256 read a prompt as fast as 512
# (2,000 tokens of Qwen2.5-Coder-1.5B: 41.5 s at 512, 42.6 at 256, 41.9 at 128, 2-core AMD EPYC) for half the
# buffers (100 MiB less for the 1.5B pair after a 2,000-token prompt); a GPU reads wider passes faster
N_BATCH_CPU, N_BATCH_GPU = 256, 512
# a compact cache's keys and values (values only under flash attention: llama.cpp's rule) in q8_0: 34 bytes per 32
COMPACT_TYPE, COMPACT_BYTES = llama_cpp.GGML_TYPE_Q8_0, 34 / 32


_uses = itertools.count(1)


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
        n_batch: int | None = None,
        flash_attn: bool = False,
        repack: bool | None = None,
        kv_memory_share: float = KV_MEMORY_SHARE,
        snapshots: int = MAX_SNAPSHOTS,
        n_seq: int = 1,
        load_mtp: bool = False,
        compact_cache: bool = False,
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
        otherwise).
        compact_cache: keys and values in q8_0, about half the memory: for a draft model, whose
        rounding moves only what it proposes, never what is accepted (Qwen2.5-Coder-0.5B's greedy
        continuation of 1,500 tokens of source: the same for 77 tokens, its step 35 ms for 41 with
        f16, 2-core AMD EPYC); a target's cache stays f16, as llama.cpp's default, for its law, and
        so does a recurrent or hybrid model's.
        n_batch: tokens a llama_decode reads at most (None: N_BATCH_CPU, or N_BATCH_GPU with layers
        offloaded)."""
        self.llama_context = self._batch = None
        self.path = check_gguf(path)
        self.n_threads = n_threads or os.cpu_count() or 1
        self.n_gpu_layers = n_gpu_layers
        self.compact_cache, self.flash_attn = compact_cache, flash_attn
        n_batch = n_batch or (N_BATCH_GPU if n_gpu_layers else N_BATCH_CPU)
        if repack is None:
            repack = choose_repack(self.path, self.n_threads, n_gpu_layers)
        self.repack = repack
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers
        model_params.use_extra_bufts = repack
        if repack:  # repacked weights are copies: read the file, as a mapping would keep it resident twice over
            model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        model_params.load_mtp = load_mtp
        self._model = load_gguf(self.path, model_params)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_seq, self.seq = n_seq, 0  # seq: the sequence eval() and the cache work on (see use())
        self.states = [SequenceState() for _ in range(n_seq)]
        self.state = self.states[0]
        self.decodes = 0  # llama_decode calls so far, of all sequences
        self.prompt_cache: PromptCache | None = None  # saved states of other prompts (see prompt_cache.py)
        self.cache = Cache(self)  # its ways back, states saved and restored (kv_cache.py)
        self.hidden = HiddenExport(self)  # hidden states kept for MTP layers (hidden_states.py)
        self.recurrent = bool(
            llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model)
        )
        if self.recurrent:  # a tiny Jamba drafting from a q8_0 cache had none of 1,500 drafts taken (f16: many)
            self.compact_cache = False
        sizes = self._state_sizes(n_batch) if self.recurrent else None
        if n_ctx is None:
            n_ctx = self.default_context(kv_memory_share, sizes.per_token if sizes else self.kv_bytes_per_token)
        # a tree's branches are sequences of one unified cache, sharing the cells of what they share;
        # llama.cpp refuses such a batch where sequences have cells of their own (n_seq > 1) and on a
        # Mamba, and splits a hybrid's into one pass per branch (a tree could never beat its chain)
        self.branches = TREE_BRANCHES if n_seq == 1 and not self.recurrent else 0
        self.tree: TreePass | None = None  # the last tree pass, until Cache.keep settles it
        self.n_snapshots = 0
        if sizes is not None and snapshots > 0:
            fit = int(SNAPSHOT_MEMORY_SHARE * physical_memory()) // max(sizes.recurrent * n_seq, 1)
            self.n_snapshots = min(snapshots, fit)
        self._make_context(n_ctx, n_batch, flash_attn)
        if self.n_snapshots and not self.cache.snapshots_work():  # not for this architecture, or not exact here
            self.n_snapshots = 0
            self._free_context()
            self._make_context(n_ctx, n_batch, flash_attn)

    @property
    def tokens(self) -> list[int]:
        """What the cache holds in the current sequence."""
        return self.state.tokens

    @property
    def llama_model(self):
        """llama.cpp's model (for a second context on its weights: heads.py)."""
        return self._model

    def use(self, seq: int) -> None:
        """Work on sequence `seq` from now on (each request answered at once has its own)."""
        self.seq, self.state = seq, self.states[seq]
        self.state.last_used = next(_uses)

    def sequence_tokens(self, seq: int) -> list[int]:
        """What the cache holds in sequence `seq`."""
        return self.states[seq].tokens

    @property
    def cells_used(self) -> int:
        """Tokens all sequences hold (of their n_seq * n_ctx cells)."""
        return sum(len(s.tokens) for s in self.states)

    def last_used(self, seq: int) -> int:
        """When use() last chose sequence `seq` (0: never; larger: later)."""
        return self.states[seq].last_used

    @property
    def can_shift(self) -> bool:
        """Whether cached cells can move to other positions (an attention cache: kv_cache's shift_runs)."""
        return not self.recurrent and bool(llama_cpp.llama_memory_can_shift(self.llama_memory))

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
        if self.compact_cache:
            ctx_params.type_k = COMPACT_TYPE
            if flash_attn:
                ctx_params.type_v = COMPACT_TYPE
        ctx_params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        self.llama_context = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self.llama_context and self.compact_cache:  # its rows are no whole q8_0 blocks (32 values): f16
            self.compact_cache = False
            return self._make_context(n_ctx, n_batch, flash_attn, n_snapshots=n_snapshots)
        if not self.llama_context:
            self.close()
            raise EdgespecError(f"llama.cpp could not create a {n_ctx}-token context for {self.path}; lower --ctx")
        self.llama_memory = llama_cpp.llama_get_memory(self.llama_context)
        if self.hidden.width:  # (a context made again: set_flash_attn)
            self.hidden.switch_on()
        if n_snapshots is None and self.n_snapshots:  # llama.cpp keeps none for architectures without them
            self.n_snapshots = min(self.n_snapshots, llama_cpp.llama_n_rs_seq(self.llama_context))
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self.llama_context)  # a sequence's (llama.cpp rounds it up to 256)
        self.n_batch = llama_cpp.llama_n_batch(self.llama_context)  # llama.cpp caps it at n_ctx
        self.flash_attn = flash_attn
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1 + getattr(self, "branches", 0))
        self.states = [SequenceState() for _ in range(self.n_seq)]
        self.state = self.states[self.seq]

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
        """What one token takes in the KV cache of a transformer: keys and values (f16, or q8_0 in a
        compact cache) of every layer."""
        m = self._model
        head_dim = llama_cpp.llama_model_n_embd(m) // max(llama_cpp.llama_model_n_head(m), 1)
        key = COMPACT_BYTES if self.compact_cache else 2
        value = COMPACT_BYTES if self.compact_cache and self.flash_attn else 2
        return int((key + value) * llama_cpp.llama_model_n_layer(m) * llama_cpp.llama_model_n_head_kv(m) * head_dim)

    @property
    def cache_types(self) -> str:
        """The KV cache's key and value types, as a saved state's folder tells them apart."""
        key = "q8_0" if self.compact_cache else "f16"
        return f"{key}/{key if self.flash_attn else 'f16'}"

    def default_context(self, memory_share: float = KV_MEMORY_SHARE, bytes_per_token: int | None = None) -> int:
        """A sequence's share of the trained context, capped so that the KV cache fits memory_share
        of this machine's memory: n_seq sequences split what one would have, as llama-server's
        slots split its context (a 1.5B pair's server of four held 6.3 GB when each had all of
        it); a purely recurrent model keeps nothing per token: its context is only a position limit."""
        per_token = self.kv_bytes_per_token if bytes_per_token is None else bytes_per_token
        if per_token <= 0:
            return self.n_ctx_train
        fits = int(memory_share * physical_memory() / per_token)
        return max(min(self.n_ctx_train, fits) // self.n_seq // 256 * 256, min(MIN_DEFAULT_CTX, self.n_ctx_train))

    def _state_sizes(self, n_batch: int) -> StateSizes:
        """Measured in a small context of its own (a hybrid's layers differ: the API has no per-layer
        head counts): the serialized state after 1 and after 9 tokens, and its recurrent part."""
        self._make_context(64, min(n_batch, 64), False, n_snapshots=0)
        try:
            self.eval([0])
            one = llama_cpp.llama_state_seq_get_size(self.llama_context, self.seq)
            recurrent = llama_cpp.llama_state_seq_get_size_ext(self.llama_context, self.seq, PARTIAL_ONLY)
            self.eval([0] * 8)
            nine = llama_cpp.llama_state_seq_get_size(self.llama_context, self.seq)
        finally:
            self._free_context()
        return StateSizes(per_token=max(nine - one, 0) // 8, recurrent=recurrent)

    # --- vocabulary -------------------------------------------------------
    # --- KV cache ---------------------------------------------------------
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
            status = llama_cpp.llama_decode(self.llama_context, self._batch)
            self.state.snapshot_pending = False
            if status != 0:
                self.cache.clear()  # what llama.cpp kept of a failed pass is not known: start again from nothing
                raise self._failure(status, len(chunk))
            self.decodes += 1
            self.state.last_pass, self.state.last_decode = len(chunk), self.decodes
            self.tokens.extend(chunk)
            self.state.keep_hidden(self.hidden.written(0, len(chunk), len(self.tokens)))
        if rows is not None:
            ptr = llama_cpp.llama_get_logits(self.llama_context)
            return np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llama_context, -1), shape=(self.n_vocab,))

    def _eval_tree(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        """A pass over the cache's missing tokens and a tree of drafts after them (see Pass.parents),
        in one llama_decode: each branch (root to leaf) is a sequence, a token shared by several
        branches is one cell with all their ids, so every node attends to its own ancestors alone.
        Returns the rows of the last token before the nodes and of every node, in node order.
        The current sequence holds the branch of first children until Cache.keep() settles the pass."""
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
            self.cache.check(llama_cpp.llama_memory_seq_rm(self.llama_memory, spare, -1, -1))
            llama_cpp.llama_memory_seq_cp(self.llama_memory, self.seq, spare, -1, -1)
        depth: list[int] = []  # a node's, below the root's children
        for parent in parents:
            depth.append(depth[parent] + 1 if parent >= 0 else 0)
        # the first branch's cells first: kept (see Cache.keep), they follow the cache's with no gap
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
        status = llama_cpp.llama_decode(self.llama_context, batch)
        self.state.snapshot_pending = False
        if status != 0:
            for spare in spares:
                llama_cpp.llama_memory_seq_rm(self.llama_memory, spare, -1, -1)
            self.cache.clear()
            raise self._failure(status, 1 + n_nodes)
        self.decodes += 1
        self.state.last_pass, self.state.last_decode = 1 + n_nodes, self.decodes
        self.tokens.append(root)
        self.tokens.extend(nodes[node] for node in first)
        in_node_order = np.argsort([-1, *order]) if n_nodes else [0]
        hidden = self.hidden.rows(1 + n_nodes)[in_node_order] if self.hidden.width else None
        self.tree = TreePass(at, first, spares, hidden)
        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits(self.llama_context), shape=(1 + n_nodes, self.n_vocab)
        )
        return logits[in_node_order]

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
        return EngineFault(
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
            state = self.states[one.seq]
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
        status = llama_cpp.llama_decode(self.llama_context, self._batch)
        seconds = perf_counter() - start
        self.decodes += 1
        if status != 0:
            # what llama.cpp kept of the batch is not known: each sequence is cut back to its own
            # tokens and its pass decoded alone, so that only a pass llama.cpp refuses fails
            for one in ok:
                self.use(one.seq)
                if not llama_cpp.llama_memory_seq_rm(self.llama_memory, one.seq, len(self.state.tokens), -1):
                    self.cache.clear()
            for one in ok:
                self._decode_alone(one)
                if one.logits is not None:  # a view into llama.cpp's buffer, which the next pass overwrites
                    one.logits = np.array(one.logits)
            return
        rows = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits(self.llama_context), shape=(sum(p.rows or 1 for p in ok), self.n_vocab)
        )
        row = index = 0
        for one in ok:
            state = self.states[one.seq]
            n = one.rows or 1
            one.logits = rows[row : row + n] if one.rows is not None else rows[row]
            row += n
            state.tokens.extend(one.tokens)
            state.keep_hidden(self.hidden.written(index, len(one.tokens), len(state.tokens)))
            index += len(one.tokens)
            state.snapshot_pending = False
            state.last_pass, state.last_decode = len(one.tokens), self.decodes
            one.seconds = seconds
            one.beside = tuple((p.seq, len(p.tokens)) for p in ok if p is not one)

    # --- lifetime ---------------------------------------------------------
    def _free_context(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self.llama_context:
            llama_cpp.llama_free(self.llama_context)
            self.llama_context = None

    def close(self) -> None:
        self._free_context()
        super().close()


def physical_memory() -> int:
    """Bytes of memory this machine has (8 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30
