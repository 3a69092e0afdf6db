"""Tiny random-weight GGUFs of architectures whose memory is not (only) an attention cache,
written with the gguf package and SmolLM2's tokenizer: llama.cpp loads and runs them as
it would the real models, so rollback is tested on real contexts in a second.

Weights are large enough (embeddings of standard deviation 1, tied to the output) that
the logits are peaked: greedy answers have few near-ties, and random models soon repeat
themselves, so copies are accepted and rejected.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
from gguf.scripts.gguf_new_metadata import get_field_data

N_EMBD = 64
N_LAYER = 4
N_HEAD = 4
N_FF = 128
D_STATE, D_CONV, DT_RANK = 8, 4, 8  # Mamba's scan: state size, convolution width, Δ's rank
L_CACHE = 3  # LFM2's short convolution


@functools.cache  # a 262k vocabulary takes seconds to read
def _tokenizer_fields(source: Path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    reader = gguf.GGUFReader(source, "r")
    fields = []
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.") and name != gguf.Keys.Tokenizer.CHAT_TEMPLATE:
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            fields.append((name, get_field_data(reader, name), vtype, sub))
        elif name == gguf.Keys.Tokenizer.CHAT_TEMPLATE:
            fields.append((name, get_field_data(reader, name), gguf.GGUFValueType.STRING, None))
    return tuple(fields)


def _write_out(writer: gguf.GGUFWriter, fields, tensors: dict[str, np.ndarray]) -> None:
    """The tokenizer's fields and the tensors (as float32) into the file, and close it."""
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, value, vtype, sub in fields:
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _mamba_layer(rng, prefix: str, *, normed: bool) -> dict[str, np.ndarray]:
    d_inner = 2 * N_EMBD
    tensors = {
        "ssm_in.weight": rng.normal(0, 0.2, (2 * d_inner, N_EMBD)),
        "ssm_conv1d.weight": rng.normal(0, 0.5, (d_inner, D_CONV)),
        "ssm_conv1d.bias": rng.normal(0, 0.1, d_inner),
        "ssm_x.weight": rng.normal(0, 0.2, (DT_RANK + 2 * D_STATE, d_inner)),
        "ssm_dt.weight": rng.normal(0, 0.2, (d_inner, DT_RANK)),
        "ssm_dt.bias": rng.normal(-1, 0.1, d_inner),
        "ssm_a": -np.exp(rng.normal(0, 0.5, (d_inner, D_STATE))),  # negative: a decaying state
        "ssm_d": np.ones(d_inner),
        "ssm_out.weight": rng.normal(0, 0.2, (N_EMBD, d_inner)),
    }
    if normed:  # Jamba normalises Δ, B and C
        tensors |= {"ssm_dt_norm.weight": np.ones(DT_RANK), "ssm_b_norm.weight": np.ones(D_STATE)}
        tensors |= {"ssm_c_norm.weight": np.ones(D_STATE)}
    return {f"{prefix}.{name}": value for name, value in tensors.items()}


def _attention_layer(rng, prefix: str, *, qk_norm: bool) -> dict[str, np.ndarray]:
    head = N_EMBD // N_HEAD
    tensors = {f"attn_{x}.weight": rng.normal(0, 0.3, (N_EMBD, N_EMBD)) for x in ("q", "k", "v", "output")}
    if qk_norm:
        tensors |= {"attn_q_norm.weight": np.ones(head), "attn_k_norm.weight": np.ones(head)}
    return {f"{prefix}.{name}": value for name, value in tensors.items()}


def _ffn(rng, prefix: str, *, norm: bool) -> dict[str, np.ndarray]:
    tensors = {
        f"{prefix}.ffn_gate.weight": rng.normal(0, 0.2, (N_FF, N_EMBD)),
        f"{prefix}.ffn_up.weight": rng.normal(0, 0.2, (N_FF, N_EMBD)),
        f"{prefix}.ffn_down.weight": rng.normal(0, 0.2, (N_EMBD, N_FF)),
    }
    return tensors | ({f"{prefix}.ffn_norm.weight": np.ones(N_EMBD)} if norm else {})


def _delta_net_layer(rng, prefix: str) -> dict[str, np.ndarray]:
    """Qwen3.5's Gated DeltaNet (linear attention) layer."""
    key_dim, value_dim = GDN_HEAD * GDN_K_HEADS, GDN_HEAD * GDN_V_HEADS
    conv_dim = 2 * key_dim + value_dim
    tensors = {
        "attn_qkv.weight": rng.normal(0, 0.2, (conv_dim, N_EMBD)),
        "attn_gate.weight": rng.normal(0, 0.2, (value_dim, N_EMBD)),
        "ssm_conv1d.weight": rng.normal(0, 0.5, (conv_dim, D_CONV)),
        "ssm_dt.bias": rng.normal(0, 0.1, GDN_V_HEADS),
        "ssm_a": -np.exp(rng.normal(0, 0.5, GDN_V_HEADS)),
        "ssm_beta.weight": rng.normal(0, 0.2, (GDN_V_HEADS, N_EMBD)),
        "ssm_alpha.weight": rng.normal(0, 0.2, (GDN_V_HEADS, N_EMBD)),
        "ssm_norm.weight": np.ones(GDN_HEAD),
        "ssm_out.weight": rng.normal(0, 0.2, (N_EMBD, value_dim)),
    }
    return {f"{prefix}.{name}": value for name, value in tensors.items()}


def _gated_attention_layer(rng, prefix: str) -> dict[str, np.ndarray]:
    """Qwen3.5's full attention: the query projection also gives the output gate."""
    head = N_EMBD // N_HEAD
    tensors = {
        "attn_q.weight": rng.normal(0, 0.3, (2 * N_EMBD, N_EMBD)),
        "attn_k.weight": rng.normal(0, 0.3, (head * QWEN35_KV_HEADS, N_EMBD)),
        "attn_v.weight": rng.normal(0, 0.3, (head * QWEN35_KV_HEADS, N_EMBD)),
        "attn_output.weight": rng.normal(0, 0.3, (N_EMBD, N_EMBD)),
        "attn_q_norm.weight": np.ones(head),
        "attn_k_norm.weight": np.ones(head),
    }
    return {f"{prefix}.{name}": value for name, value in tensors.items()}


GDN_HEAD, GDN_K_HEADS, GDN_V_HEADS = 16, 2, 4  # Gated DeltaNet: head size, key heads, value heads
QWEN35_KV_HEADS = 2
# pure recurrent; hybrid without snapshots; hybrids with them (short convolutions; Gated DeltaNet)
ARCHS = ("mamba", "jamba", "lfm2", "qwen35")
ATTENTION_LAYERS = {"mamba": (), "jamba": (1, 3), "lfm2": (1, 3), "qwen35": (3,)}  # qwen35: every 4th
ATTENTION_LAYERS["llama"] = tuple(range(N_LAYER))  # a plain transformer: the sampling tests' fast target


def write_tiny(
    path: Path,
    arch: str,
    tokenizer: Path,
    *,
    seed: int = 0,
    noise: float = 0.0,
    split_tensors: int = 0,
    mtp: bool = False,
    chat_template: str | None = None,
) -> Path:
    """A random `arch` model at `path`; `noise` > 0 perturbs the last block's weights of `seed`
    by that share (a draft model that agrees with its target often, not always). split_tensors:
    written as a split GGUF of that many tensors a part (path's stem-0000i-of-0000N.gguf, as
    llama.cpp's gguf-split names them; the first part is returned). mtp (qwen35): a
    multi-token-prediction block after the trunk, as Qwen3.5's GGUFs have it (a full-attention
    block with the NextN tensors; random: its drafts are almost never accepted). chat_template: in
    place of the tokenizer's own."""
    rng = np.random.default_rng(seed)
    fields = _tokenizer_fields(tokenizer)
    if chat_template is not None:
        template = (gguf.Keys.Tokenizer.CHAT_TEMPLATE, chat_template, gguf.GGUFValueType.STRING, None)
        fields = [f for f in fields if f[0] != template[0]] + [template]
    n_vocab = len(next(value for name, value, *_ in fields if name == gguf.Keys.Tokenizer.LIST))
    tensors: dict[str, np.ndarray] = {"token_embd.weight": rng.normal(0, 1.0, (n_vocab, N_EMBD))}
    tensors["token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight"] = np.ones(N_EMBD)
    heads_kv = []
    for i in range(N_LAYER):
        prefix = f"blk.{i}"
        tensors[f"{prefix}.attn_norm.weight"] = np.ones(N_EMBD)
        attention = i in ATTENTION_LAYERS[arch]
        heads_kv.append(N_HEAD if attention else 0)
        if arch == "qwen35":
            tensors[f"{prefix}.post_attention_norm.weight"] = np.ones(N_EMBD)  # (its FFN's norm)
            tensors |= _gated_attention_layer(rng, prefix) if attention else _delta_net_layer(rng, prefix)
        elif attention:
            tensors |= _attention_layer(rng, prefix, qk_norm=arch == "lfm2")
        elif arch == "lfm2":
            tensors[f"{prefix}.shortconv.conv.weight"] = rng.normal(0, 0.5, (N_EMBD, L_CACHE))
            tensors[f"{prefix}.shortconv.in_proj.weight"] = rng.normal(0, 0.2, (3 * N_EMBD, N_EMBD))
            tensors[f"{prefix}.shortconv.out_proj.weight"] = rng.normal(0, 0.2, (N_EMBD, N_EMBD))
        else:
            tensors |= _mamba_layer(rng, prefix, normed=arch == "jamba")
        if arch != "mamba":
            tensors |= _ffn(rng, prefix, norm=arch != "qwen35")
    if mtp:
        prefix = f"blk.{N_LAYER}"
        tensors[f"{prefix}.attn_norm.weight"] = np.ones(N_EMBD)
        tensors[f"{prefix}.post_attention_norm.weight"] = np.ones(N_EMBD)
        tensors |= _gated_attention_layer(rng, prefix) | _ffn(rng, prefix, norm=False)
        tensors[f"{prefix}.nextn.eh_proj.weight"] = rng.normal(0, 0.2, (N_EMBD, 2 * N_EMBD))
        tensors[f"{prefix}.nextn.enorm.weight"] = np.ones(N_EMBD)
        tensors[f"{prefix}.nextn.hnorm.weight"] = np.ones(N_EMBD)
    if noise:  # in the last block only: perturbing every layer of a random network changes nearly every token
        other = np.random.default_rng(seed + 1)
        last = f"blk.{N_LAYER - 1}."
        tensors = {
            name: t + noise * t.std() * other.normal(size=t.shape) if name.startswith(last) and t.ndim > 1 else t
            for name, t in tensors.items()
        }

    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_tensors)
    writer.add_context_length(4096)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER + mtp)
    if mtp:
        writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch != "mamba":
        writer.add_feed_forward_length(N_FF)
        writer.add_head_count(N_HEAD)
        writer.add_head_count_kv(QWEN35_KV_HEADS if arch == "qwen35" else heads_kv)
    if arch == "qwen35":
        writer.add_rope_dimension_sections([3, 3, 2, 0])  # interleaved M-RoPE over the head's 8 pairs
        writer.add_rope_freq_base(10000.0)
        writer.add_uint32(f"{arch}.full_attention_interval", 4)
        writer.add_ssm_conv_kernel(D_CONV)
        writer.add_ssm_inner_size(GDN_HEAD * GDN_V_HEADS)
        writer.add_ssm_state_size(GDN_HEAD)
        writer.add_ssm_time_step_rank(GDN_V_HEADS)
        writer.add_ssm_group_count(GDN_K_HEADS)
    elif arch == "lfm2":
        writer.add_shortconv_l_cache(L_CACHE)
        writer.add_rope_freq_base(10000.0)
    elif arch != "llama":
        writer.add_ssm_conv_kernel(D_CONV)
        writer.add_ssm_inner_size(2 * N_EMBD)
        writer.add_ssm_state_size(D_STATE)
        writer.add_ssm_time_step_rank(DT_RANK)
    _write_out(writer, fields, tensors)
    return writer.format_shard_names(path)[0] if split_tensors else path


MTP_EXPERTS, MTP_EXPERTS_USED, MTP_FF_EXPERT = 4, 2, 32  # the MTP block's MoE (llama.cpp's GLM-4.5 graph has only that)


def write_tiny_mtp(
    path: Path,
    tokenizer: Path,
    *,
    seed: int = 0,
    copying: bool = False,
    loose: bool = False,
    from_state: bool = False,
    heads: bool = True,
) -> Path:
    """A GLM-4.5-shaped model (glm4moe) with a multi-token-prediction head: a dense first block
    (the trunk) and the MoE block after it that holds the NextN tensors (nextn_predict_layers 1),
    as GLM-4.5's GGUFs have them. copying: every weight but the embeddings near zero and the head's
    eh_proj = [I | 0], so the target repeats its last token and the head predicts the same: every
    draft is accepted (else random weights: almost none is). loose (with copying): small embeddings,
    so that the target's law at temperature 1 spreads beyond its repeat, and noise in eh_proj, so
    that the head's law is another: drafts accepted and rejected. from_state (with copying):
    eh_proj = [0 | I], the head reads the target's hidden state alone (which, its weights near zero,
    holds the last token): accepted only where it is given that state. heads=False: the MTP block left out
    and its count kept in the metadata, as many GGUFs of these models are made."""
    rng = np.random.default_rng(seed)
    fields = _tokenizer_fields(tokenizer)
    n_vocab = len(next(value for name, value, *_ in fields if name == gguf.Keys.Tokenizer.LIST))
    scale = 1e-4 if copying else 1.0

    def normal(std, shape):
        return rng.normal(0, std * scale, shape)

    tensors: dict[str, np.ndarray] = {"token_embd.weight": rng.normal(0, 0.1 if loose else 1.0, (n_vocab, N_EMBD))}
    tensors["output_norm.weight"] = np.ones(N_EMBD)
    for i in range(2):
        prefix = f"blk.{i}"
        tensors[f"{prefix}.attn_norm.weight"] = np.ones(N_EMBD)
        tensors[f"{prefix}.post_attention_norm.weight"] = np.ones(N_EMBD)
        tensors |= {k: normal(0.3, v.shape) for k, v in _attention_layer(rng, prefix, qk_norm=False).items()}
    tensors |= {k: v for k, v in _ffn(rng, "blk.0", norm=False).items()}
    tensors = {k: v * scale if k.startswith("blk.0.ffn") else v for k, v in tensors.items()}
    moe = "blk.1"
    tensors[f"{moe}.ffn_gate_inp.weight"] = normal(0.2, (MTP_EXPERTS, N_EMBD))
    tensors[f"{moe}.exp_probs_b.bias"] = np.zeros(MTP_EXPERTS)
    for part in ("gate", "up"):
        tensors[f"{moe}.ffn_{part}_exps.weight"] = normal(0.2, (MTP_EXPERTS, MTP_FF_EXPERT, N_EMBD))
        tensors[f"{moe}.ffn_{part}_shexp.weight"] = normal(0.2, (MTP_FF_EXPERT, N_EMBD))
    tensors[f"{moe}.ffn_down_exps.weight"] = normal(0.2, (MTP_EXPERTS, N_EMBD, MTP_FF_EXPERT))
    tensors[f"{moe}.ffn_down_shexp.weight"] = normal(0.2, (N_EMBD, MTP_FF_EXPERT))
    # eh_proj reads [normed embedding of the next token | normed hidden state of the target]
    eh_proj = np.hstack([np.eye(N_EMBD), np.zeros((N_EMBD, N_EMBD))]) if copying else normal(0.2, (N_EMBD, 2 * N_EMBD))
    if copying and from_state:  # the same prediction, read from the target's hidden state instead
        eh_proj = np.hstack([np.zeros((N_EMBD, N_EMBD)), np.eye(N_EMBD)])
    if loose:
        eh_proj += rng.normal(0, 0.03, eh_proj.shape)
    tensors[f"{moe}.nextn.eh_proj.weight"] = eh_proj
    tensors[f"{moe}.nextn.enorm.weight"] = np.ones(N_EMBD)
    tensors[f"{moe}.nextn.hnorm.weight"] = np.ones(N_EMBD)
    if not heads:
        tensors = {name: t for name, t in tensors.items() if not name.startswith(f"{moe}.")}

    arch = "glm4moe"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(4096)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(2)
    writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    writer.add_uint32(f"{arch}.leading_dense_block_count", 1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_expert_count(MTP_EXPERTS)
    writer.add_expert_used_count(MTP_EXPERTS_USED)
    writer.add_expert_shared_count(1)
    writer.add_expert_feed_forward_length(MTP_FF_EXPERT)
    _write_out(writer, fields, tensors)
    return path
