"""A GGUF's tokenizer through llama.cpp: tokens and pieces, special tokens, the chat template,
and whether two models share one tokenizer (speculation compares token ids)."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import llama_cpp
import llama_cpp._logger

from .errors import EdgespecError
from .vocabulary import FimTokens

GGUF_MAGIC = b"GGUF"

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


def header_chat_template(path: Path) -> str | None:
    """The chat template of a GGUF, read with its vocabulary alone (no weights: fast)."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = load_gguf(path, params)
    try:
        return _chat_template(model)
    finally:
        llama_cpp.llama_model_free(model)


def load_gguf(path: Path, params):
    """llama.cpp's model of a GGUF (its vocabulary alone where params.vocab_only)."""
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise EdgespecError(
            f"llama.cpp could not load {path} (truncated or corrupt GGUF); delete it and fetch it again"
        )
    return model


def _chat_template(model) -> str | None:
    raw = llama_cpp.llama_model_chat_template(model, None)
    return raw.decode("utf-8") if raw else None


class Tokenizer:
    """What a GGUF's vocabulary says. Opened alone (llama.cpp's vocab_only load: no weights
    read) to judge a draft for a target (compatibility_problem) before either is loaded; a
    Model is one with its weights and context."""

    _model = None  # llama.cpp's model: None until loaded (a path that fails leaves nothing to free)

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = check_gguf(path)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = load_gguf(self.path, params)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)

    def close(self) -> None:
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # capacity too small: -n is the size needed
            buf = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def text_tokens(self, text: str) -> list[int]:
        """Text as tokens, no special token added or parsed (an editor's text is data)."""
        return self.tokenize(text, add_special=False)

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token; may be part of a multi-byte character. special: a control
        token (<|im_end|>) as its text, where an answer's text leaves it out."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
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

    @property
    def eot(self) -> int:
        """The end-of-turn token, else the end-of-sequence one."""
        eot = llama_cpp.llama_vocab_eot(self._vocab)
        return eot if eot != llama_cpp.LLAMA_TOKEN_NULL else self.eos

    @property
    def fim(self) -> FimTokens:
        """The model's fill-in-the-middle tokens."""
        v = self._vocab

        def token(get) -> int | None:
            found = get(v)
            return None if found == llama_cpp.LLAMA_TOKEN_NULL else found

        return FimTokens(
            prefix=token(llama_cpp.llama_vocab_fim_pre),
            suffix=token(llama_cpp.llama_vocab_fim_suf),
            middle=token(llama_cpp.llama_vocab_fim_mid),
            repo=token(llama_cpp.llama_vocab_fim_rep),
            file_sep=token(llama_cpp.llama_vocab_fim_sep),
        )

    def chat_template(self) -> str | None:
        return _chat_template(self._model)

    def metadata(self, key: str) -> str:
        """A GGUF metadata value as text (general.architecture: llama, qwen2, ...); "" if absent."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else ""


def compatibility_problem(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why `draft` cannot draft for `target` (one sentence), or None if it can."""
    if reason := tokenizer_mismatch(target, draft):
        names = f"{draft.path.name} cannot draft for {target.path.name}"
        return f"{names}: {reason}; pick a draft model from the target's family"
    return None


def tokenizer_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """How the two tokenizers differ (a clause), or None where they are one.

    Speculation compares token ids, so both must share one tokenizer: same vocab
    type and special tokens, and identical token texts. A few padded entries at
    the end of the vocabulary may differ in count (as llama.cpp allows)."""
    if target.vocab_type != draft.vocab_type:
        return "different tokenizer types"
    if (target.bos, target.eos, target.add_bos) != (draft.bos, draft.eos, draft.add_bos):
        return "different special tokens (BOS/EOS)"
    if abs(target.n_vocab - draft.n_vocab) > 128:
        return f"vocabularies of {draft.n_vocab} and {target.n_vocab} tokens"
    for token in range(min(target.n_vocab, draft.n_vocab)):
        if target.token_text(token) != draft.token_text(token):
            return f"token {token} differs between the tokenizers"
    return None
