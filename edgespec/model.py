"""A thin layer over llama.cpp's low-level API: one model, one context, one sequence.

`Model.tokens` mirrors what the KV cache holds, so callers reason about the cache
as a token list: `sync()` keeps the longest common prefix with a new sequence,
`eval()` appends, `truncate()` drops the tail (llama_memory_seq_rm).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import llama_cpp
import llama_cpp._logger
import numpy as np

from .errors import EdgespecError
from .kernels import choose_repack
from .prompt_cache import MIN_TOKENS, PromptCache, common_prefix

GGUF_MAGIC = b"GGUF"
KV_MEMORY_SHARE = 0.25  # a default context's KV caches (all models of an engine) take at most this share of memory
MIN_DEFAULT_CTX = 2048  # ... but never less than this many tokens

# llama.cpp logs model loading to stderr; keep the terminal for the answer.
if not os.environ.get("EDGESPEC_VERBOSE"):
    llama_cpp._logger.logger.setLevel(logging.CRITICAL + 1)
llama_cpp.llama_backend_init()


def check_gguf(path: str | os.PathLike) -> Path:
    """Fail with one sentence unless `path` is a readable file that starts like a GGUF."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise EdgespecError(
            f"model file not found: {path}; pass an existing .gguf path or a name from `edgespec models`"
        )
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise EdgespecError(f"{path} is not a GGUF file; pass a llama.cpp .gguf model")
    return path


class Model:
    """A GGUF model with its own llama.cpp context (a single sequence, id 0)."""

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
    ) -> None:
        """n_ctx: context size in tokens; None: the model's trained context, or less if its
        KV cache would take more than kv_memory_share of this machine's memory.
        flash_attn: llama.cpp's flash attention, faster on some machines and slower on
        others (the loader chooses it by measurement, see calibration.py).
        repack: weights repacked into llama.cpp's extra buffer types (its default) or not
        (--no-repack); None: whichever works and runs faster here (see kernels.py: on
        some CPUs the repacked kernels crash)."""
        self.path = check_gguf(path)
        self._model = self._ctx = self._batch = None
        self.n_threads = n_threads or os.cpu_count() or 1
        self.n_gpu_layers = n_gpu_layers
        if repack is None:
            repack = choose_repack(self.path, self.n_threads, n_gpu_layers)
        self.repack = repack
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers
        model_params.use_extra_bufts = repack
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self._model:
            raise EdgespecError(
                f"llama.cpp could not load {self.path} (truncated or corrupt GGUF); delete it and fetch it again"
            )
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.tokens: list[int] = []
        self.prompt_cache: PromptCache | None = None  # saved states of other prompts (see prompt_cache.py)
        self._make_context(n_ctx or self.default_context(kv_memory_share), n_batch, flash_attn)

    def _make_context(self, n_ctx: int, n_batch: int, flash_attn: bool) -> None:
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = ctx_params.n_ubatch = n_batch
        ctx_params.n_seq_max = 1
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
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx)
        self.n_batch = llama_cpp.llama_n_batch(self._ctx)  # llama.cpp caps it at n_ctx
        self.flash_attn = flash_attn
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.tokens.clear()

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
        """What one token takes in the KV cache: keys and values (f16) of every layer."""
        m = self._model
        head_dim = llama_cpp.llama_model_n_embd(m) // max(llama_cpp.llama_model_n_head(m), 1)
        return 2 * 2 * llama_cpp.llama_model_n_layer(m) * llama_cpp.llama_model_n_head_kv(m) * head_dim

    def default_context(self, memory_share: float = KV_MEMORY_SHARE) -> int:
        """The trained context, capped so that the KV cache fits memory_share of this machine's memory."""
        fits = int(memory_share * physical_memory() / self.kv_bytes_per_token) // 256 * 256
        return max(min(self.n_ctx_train, fits), min(MIN_DEFAULT_CTX, self.n_ctx_train))

    # --- vocabulary -------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # capacity too small: -n is the size needed
            buf = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The raw bytes of one token; may be part of a multi-byte character."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return llama_cpp.llama_vocab_is_eog(self._vocab, token)

    def token_text(self, token: int) -> bytes:
        return llama_cpp.llama_vocab_get_text(self._vocab, token)

    @property
    def vocab_handle(self):
        """llama.cpp's vocabulary of this model (for its grammar engine, grammar.py)."""
        return self._vocab

    @property
    def vocab_type(self) -> int:
        return llama_cpp.llama_vocab_type(self._vocab)

    @property
    def bos(self) -> int:
        return llama_cpp.llama_vocab_bos(self._vocab)

    @property
    def eos(self) -> int:
        return llama_cpp.llama_vocab_eos(self._vocab)

    @property
    def add_bos(self) -> bool:
        return llama_cpp.llama_vocab_get_add_bos(self._vocab)

    def chat_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    # --- KV cache ---------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Drop cached tokens at positions >= n."""
        if n < len(self.tokens):
            llama_cpp.llama_memory_seq_rm(self._memory, 0, n, -1)
            del self.tokens[n:]

    def sync(self, tokens: list[int]) -> int:
        """Keep the longest cached prefix of `tokens`, but never the last token, whose
        logits the caller needs from a fresh eval; with a prompt cache, a saved state
        that shares more of `tokens` is brought back (and the one that would be cut, kept).
        Returns how many tokens were kept."""
        n = common_prefix(self.tokens, tokens, len(tokens) - 1)  # called every round: compared in C
        # a prompt of another conversation (a round discards fewer): keep what would be lost, bring back a better one
        if self.prompt_cache is not None and max(len(tokens) - 1, len(self.tokens)) - n >= MIN_TOKENS:
            n = self.prompt_cache.swap(self, tokens, n)
        self.truncate(n)
        return n

    def save_state(self):
        """The cache's contents (sequence 0) as llama.cpp serializes them, or None."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, 0)
        data = (ctypes.c_uint8 * size)()
        return data if llama_cpp.llama_state_seq_get_data(self._ctx, data, size, 0) == size else None

    def restore_state(self, tokens: list[int], data) -> bool:
        """Load a state from save_state() that holds `tokens`; False (cache empty) if llama.cpp refuses it."""
        self.truncate(0)
        if llama_cpp.llama_state_seq_set_data(self._ctx, data, len(data), 0) != len(data):
            llama_cpp.llama_memory_seq_rm(self._memory, 0, 0, -1)
            return False
        self.tokens[:] = tokens
        return True

    def eval(self, tokens: list[int], *, all_logits: bool = False) -> np.ndarray | None:
        """Append `tokens` to the cache in one forward pass (chunked by n_batch).

        Returns logits as a float32 view into llama.cpp's buffer, valid until the
        next eval: shape (len(tokens), n_vocab) with all_logits, else the last
        token's row (n_vocab,). Returns None for an empty list."""
        if not tokens:
            return None
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextFull(self.n_ctx)
        if all_logits and len(tokens) > self.n_batch:
            raise ValueError(f"all_logits needs at most n_batch={self.n_batch} tokens")
        batch = self._batch
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            last_chunk = start + self.n_batch >= len(tokens)
            pos0 = len(self.tokens)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or (last_chunk and i == len(chunk) - 1)
            batch.n_tokens = len(chunk)
            status = llama_cpp.llama_decode(self._ctx, batch)
            if status != 0:
                self.truncate(pos0)
                raise RuntimeError(f"llama_decode failed with status {status}")
            self.tokens.extend(chunk)
        if all_logits:
            ptr = llama_cpp.llama_get_logits(self._ctx)
            return np.ctypeslib.as_array(ptr, shape=(len(tokens), self.n_vocab))
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, -1), shape=(self.n_vocab,))

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
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()


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


def compatibility_problem(target: Model, draft: Model) -> str | None:
    """Why `draft` cannot draft for `target` (one sentence), or None if it can.

    Speculation compares token ids, so both must share one tokenizer: same vocab
    type and special tokens, and identical token texts. A few padded entries at
    the end of the vocabulary may differ in count (as llama.cpp allows)."""
    names = f"{draft.path.name} cannot draft for {target.path.name}"
    if target.vocab_type != draft.vocab_type:
        return f"{names}: different tokenizer types; pick a draft model from the target's family"
    if (target.bos, target.eos, target.add_bos) != (draft.bos, draft.eos, draft.add_bos):
        return f"{names}: different special tokens (BOS/EOS); pick a draft model from the target's family"
    if abs(target.n_vocab - draft.n_vocab) > 128:
        return (
            f"{names}: vocabularies of {draft.n_vocab} and {target.n_vocab} tokens; "
            "pick a draft model from the target's family"
        )
    for token in range(min(target.n_vocab, draft.n_vocab)):
        if target.token_text(token) != draft.token_text(token):
            return f"{names}: token {token} differs between the tokenizers; pick a draft model from the target's family"
    return None
