"""Random-weight models of the default pair's shapes for the GPU check (scripts/gpu-check.sh),
written with numpy and the gguf package alone, so they are written while llama.cpp builds;
gpu_check.py quantizes them once llama.cpp is there.

    python scripts/gpu_models.py write --out DIR --tokenizer QWEN.gguf [--small]   # DIR/{target,draft}.f16.gguf
    python scripts/gpu_models.py tokenizer MODEL.gguf OUT.gguf   # a GGUF's tokenizer fields alone
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.scripts.gguf_new_metadata import get_field_data

LAYER_GAIN = 0.1  # a random layer's output against its input (rms): the stream stays the token's embedding
SEEDS = {"target": 0, "draft": 1}  # an unrelated draft model: another seed
WRITTEN = "written.json"  # what write() took, for the report


@dataclass(frozen=True)
class Shape:
    """A Qwen2 model's size (the vocabulary comes with the tokenizer)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int


SHAPES = {  # Qwen2.5-Coder-1.5B and -0.5B as they are; a small pair for CPUs and CI
    "full": {"target": Shape(1536, 28, 12, 2, 8960), "draft": Shape(896, 24, 14, 2, 4864)},
    "small": {"target": Shape(256, 4, 4, 2, 512), "draft": Shape(128, 2, 4, 2, 256)},
}


def tokenizer_fields(source: Path) -> list[tuple]:
    """The tokenizer.* fields of a GGUF (its chat template included): name, value, type, item type."""
    reader = gguf.GGUFReader(source, "r")
    fields = []
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            fields.append((name, get_field_data(reader, name), vtype, sub))
    return fields


def write_tokenizer(source: Path, out: Path) -> Path:
    """A GGUF of `source`'s tokenizer fields alone (no tensors): what the check carries."""
    writer = gguf.GGUFWriter(out, "qwen2")
    for name, value, vtype, sub in tokenizer_fields(source):
        writer.add_key_value(name, value, vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_f16(path: Path, shape: Shape, fields: list[tuple], seed: int) -> Path:
    """A random Qwen2 model of `shape` with these tokenizer fields, in F16 (gpu_check.py
    quantizes it to Q4_K_M, as the registry's files are). Its answers are known by
    construction: after a word (a token of a space and lowercase letters) comes the word that
    a random permutation of the words says, by a margin no float rounding can overturn. The
    layers are weak (LAYER_GAIN), so the stream stays its last token's embedding, and the
    output matrix is the embeddings moved to the rows of their successors (zero for tokens
    that are not words). So greedy and sampled answers agree, an answer's text tokenizes back
    to its tokens (a prediction of it is exact), a model of another seed is an unrelated
    draft (α ≈ 0), and the passes cost what the real shapes cost."""
    rng = np.random.default_rng(seed)
    vocab = next(value for name, value, *_ in fields if name == gguf.Keys.Tokenizer.LIST)
    head = shape.n_embd // shape.n_head
    kv = head * shape.n_head_kv

    def weight(rows, cols, gain=LAYER_GAIN):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (gain / cols**0.5)).astype(np.float16)

    embeddings = weight(len(vocab), shape.n_embd, gain=shape.n_embd**0.5)  # entries of standard deviation 1
    words = np.flatnonzero(_words(vocab))
    output = np.zeros_like(embeddings)
    output[rng.permutation(words)] = embeddings[words]  # row of a word's successor: that word's embedding
    tensors = {
        "token_embd.weight": embeddings,
        "output.weight": output,
        "output_norm.weight": np.ones(shape.n_embd, np.float32),
    }
    for i in range(shape.n_layer):
        b = f"blk.{i}"
        tensors |= {
            f"{b}.attn_norm.weight": np.ones(shape.n_embd, np.float32),
            f"{b}.attn_q.weight": weight(shape.n_embd, shape.n_embd),
            f"{b}.attn_q.bias": np.zeros(shape.n_embd, np.float32),
            f"{b}.attn_k.weight": weight(kv, shape.n_embd),
            f"{b}.attn_k.bias": np.zeros(kv, np.float32),
            f"{b}.attn_v.weight": weight(kv, shape.n_embd),
            f"{b}.attn_v.bias": np.zeros(kv, np.float32),
            f"{b}.attn_output.weight": weight(shape.n_embd, shape.n_embd),
            f"{b}.ffn_norm.weight": np.ones(shape.n_embd, np.float32),
            f"{b}.ffn_gate.weight": weight(shape.n_ff, shape.n_embd),
            f"{b}.ffn_up.weight": weight(shape.n_ff, shape.n_embd),
            f"{b}.ffn_down.weight": weight(shape.n_embd, shape.n_ff),
        }
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, value, vtype, sub in fields:
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _words(vocab: list[str]) -> np.ndarray:
    """1 for a byte-level BPE token that is a space ("Ġ") and two or more lowercase letters, else 0."""
    return np.array(
        [len(t) > 2 and t[0] == "Ġ" and t[1:].isascii() and t[1:].isalpha() and t[1:].islower() for t in vocab],
        dtype=np.float16,
    )


def write(out: Path, tokenizer: Path, small: bool) -> dict[str, Path]:
    """The target and draft models in F16 under `out`, and what that took (WRITTEN)."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    fields = tokenizer_fields(tokenizer)
    shapes = SHAPES["small" if small else "full"]
    paths = {role: write_f16(out / f"{role}.f16.gguf", shapes[role], fields, SEEDS[role]) for role in SEEDS}
    (out / WRITTEN).write_text(json.dumps({"seconds": time.perf_counter() - start, "small": small}))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    models = commands.add_parser("write", help="the target and the draft model, in F16")
    models.add_argument("--out", type=Path, required=True)
    models.add_argument("--tokenizer", type=Path, required=True, help="a GGUF whose tokenizer fields the models get")
    models.add_argument("--small", action="store_true", help="small shapes (a CPU, CI) instead of the real ones")
    tokenizer = commands.add_parser("tokenizer", help="keep a GGUF's tokenizer fields alone, in a small GGUF")
    tokenizer.add_argument("source", type=Path)
    tokenizer.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "tokenizer":
        write_tokenizer(args.source, args.out)
    else:
        write(args.out, args.tokenizer, args.small)


if __name__ == "__main__":
    main()
