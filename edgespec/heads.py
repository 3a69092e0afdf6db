"""The target's own multi-token-prediction layers (MTP, "NextN": DeepSeek-V3's, GLM-4.5's,
Qwen3.5's), run as llama.cpp runs them: a context of their own on the target's weights
(LLAMA_CONTEXT_TYPE_MTP), whose layer reads for the token at position p its embedding and the
target's hidden state at p - 1, and gives the logits of the token at p + 1 and a hidden state of
its own (which the next step of a chain reads in place of the target's). A thin layer over
llama.cpp's extended batch API, every call's result checked.
"""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path
from types import SimpleNamespace

import llama_cpp
import llama_cpp.llama_cpp_ext as llama_ext
import numpy as np
from llama_cpp._ctypes_extensions import load_shared_library

from .errors import EdgespecError, EngineFault
from .hub import split_parts
from .model import Model

HEAD_TENSOR = re.compile(rb"^blk\.\d+\.nextn\.eh_proj\.weight$")  # the tensor every MTP block has
LIBRARY_FOLDER = Path(llama_cpp.__file__).parent / "lib"


class _GgufInitParams(ctypes.Structure):  # ggml's gguf_init_params
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


@functools.cache
def _gguf_api() -> SimpleNamespace | None:
    """ggml's GGUF reader (gguf_init_from_file...), from the libraries llama-cpp-python ships: found
    through libllama where the platform's loader searches its dependencies, else in ggml-base;
    None where neither has it (then no file is taken to have heads)."""
    libraries = [lambda: llama_cpp.llama_cpp._lib, lambda: load_shared_library("ggml-base", LIBRARY_FOLDER)]
    for library in libraries:
        try:
            lib = library()
            api = SimpleNamespace(
                init=lib.gguf_init_from_file, n_tensors=lib.gguf_get_n_tensors,
                tensor_name=lib.gguf_get_tensor_name, free=lib.gguf_free,
            )  # fmt: skip
        except (AttributeError, OSError, RuntimeError, FileNotFoundError):
            continue
        api.init.argtypes, api.init.restype = [ctypes.c_char_p, _GgufInitParams], ctypes.c_void_p
        api.n_tensors.argtypes, api.n_tensors.restype = [ctypes.c_void_p], ctypes.c_int64
        api.tensor_name.argtypes, api.tensor_name.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_char_p
        api.free.argtypes, api.free.restype = [ctypes.c_void_p], None
        return api
    return None


def has_heads(path: Path) -> bool:
    """Whether the GGUF (all parts of a split one) holds MTP layers. Judged by their tensors, not
    the metadata: many GGUFs keep `nextn_predict_layers` with the layers stripped, and llama.cpp
    aborts the process when an MTP context is made without them."""
    parts = [path.with_name(name) for name in split_parts(path.name)]
    return any(_holds_head(part) for part in parts if part.is_file())


def _holds_head(path: Path) -> bool:
    if (api := _gguf_api()) is None:
        return False
    gguf = api.init(str(path).encode(), _GgufInitParams(True, None))  # the header alone
    if not gguf:
        return False
    try:
        return any(HEAD_TENSOR.match(api.tensor_name(gguf, i)) for i in range(api.n_tensors(gguf)))
    finally:
        api.free(gguf)


class Heads:
    """The MTP layers of a target Model (loaded with load_mtp) in a context of their own, with
    as many sequences as the target's; positions(seq) is how many positions of a sequence its
    cache holds (each written with the target's hidden state before it)."""

    def __init__(self, target: Model) -> None:
        if not llama_cpp.llama_model_n_layer_nextn(target.llama_model):
            raise EdgespecError(f"{target.path.name} was loaded without its MTP layers; report this as a bug")
        self.target = target
        self.width = llama_cpp.llama_model_n_embd_out(target.llama_model)
        params = llama_cpp.llama_context_default_params()
        params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        params.n_ctx = target.n_ctx * target.n_seq
        params.n_batch = params.n_ubatch = target.n_batch
        params.n_seq_max = target.n_seq
        params.kv_unified = target.n_seq == 1  # as the target's (see Model.__init__)
        params.n_threads = params.n_threads_batch = target.n_threads
        params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(target.llama_model, params)
        if not self._ctx:
            raise EdgespecError(f"llama.cpp could not make a context for the MTP layers of {target.path.name}")
        self._batch = llama_cpp.llama_batch_ext_init(self._ctx)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        llama_ext.llama_set_embeddings_nextn(self._ctx, True, True)  # its own hidden state, of its output rows
        self.n_vocab = target.n_vocab
        self._positions = [0] * target.n_seq

    def positions(self, seq: int) -> int:
        return self._positions[seq]

    def cut(self, seq: int, n: int) -> None:
        """Drop the positions >= n of sequence `seq`."""
        if n < self._positions[seq]:
            if not llama_cpp.llama_memory_seq_rm(self._memory, seq, n, -1):
                raise EngineFault("llama.cpp refused to cut the MTP layers' cache; report this as a bug")
            self._positions[seq] = n

    def read(self, seq: int, tokens: list[int], hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write `tokens` at the sequence's next positions, token i with the hidden state hidden[i]
        (of the position before it), in passes of n_batch at most; the logits of the token after
        the last, and the layers' own hidden state there (copies)."""
        if len(tokens) != len(hidden) or not tokens:
            raise ValueError(f"{len(tokens)} tokens need as many hidden states, got {len(hidden)}")
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        step = self.target.n_batch
        for at in range(0, len(tokens), step):
            self._decode(seq, tokens[at : at + step], hidden[at : at + step], last=at + step >= len(tokens))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, -1), shape=(self.n_vocab,))
        state = llama_ext.llama_get_embeddings_nextn_ith(self._ctx, -1)
        if not state:
            raise EngineFault("llama.cpp gave no hidden state of the MTP layers; report this as a bug")
        return logits.copy(), np.ctypeslib.as_array(state, shape=(self.width,)).copy()

    def _decode(self, seq: int, tokens: list[int], hidden: np.ndarray, *, last: bool) -> None:
        batch, pos = self._batch, llama_cpp.llama_pos(self._positions[seq])
        llama_cpp.llama_batch_ext_clear(batch)
        for i, token in enumerate(tokens):
            row = llama_cpp.llama_embd(hidden[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.width)
            if (
                (idx := llama_cpp.llama_batch_ext_add_token(batch, seq, token)) < 0
                or not llama_cpp.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos))
                or not llama_cpp.llama_batch_ext_set_embd_token(batch, idx, row)
                or (last and i == len(tokens) - 1 and not llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True))
            ):
                raise EngineFault(f"llama.cpp refused token {token} for the MTP layers; report this as a bug")
            pos.value += 1
        status = llama_cpp.llama_process(self._ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
        if status != 0:
            llama_cpp.llama_memory_seq_rm(self._memory, seq, 0, -1)  # what llama.cpp kept of a failed pass is not known
            self._positions[seq] = 0
            raise EngineFault(f"llama.cpp failed to run the MTP layers (status {status}); use --no-draft")
        self._positions[seq] = pos.value

    def close(self) -> None:
        if self._batch:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self.close()
