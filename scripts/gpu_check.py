"""The GPU check's measurements (scripts/gpu-check.sh builds llama.cpp, then runs this).

Random-weight models with the real shapes of the default pair (Qwen2.5-Coder 1.5B target,
0.5B draft) and Qwen's real tokenizer, quantized as the registry's files are (Q4_K_M), so a
machine without the real weights (offline, 64 MiB carried in) still times what they would
cost. Acceptance is known by construction instead of measured on real text: a prediction that
is the target's own greedy answer and a draft model that is the target itself are always
right (α = 1); an unrelated random draft model is almost never right (α ≈ 0).

Reports, as JSON and Markdown under --out:
- greedy equality of every draft mode with the target alone;
- the calibrated V(k) and the draft model's step, in seconds and in target steps;
- where a round's time goes: the models' passes, and the Python around them (sampling and
  acceptance, planning and drafting, the rest), greedy and sampled;
- bench rows for each known α: speed against the target alone in the same process (modes
  alternating, median of the repeats), the ceiling, and what the controller chose.

    python scripts/gpu_check.py run --out DIR --tokenizer QWEN.gguf [--gpu-layers 99] [--small]
    python scripts/gpu_check.py tokenizer MODEL.gguf OUT.gguf   # a GGUF's tokenizer fields alone
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
from gguf.scripts.gguf_new_metadata import get_field_data

import edgespec
from edgespec import Request, SamplingParams, Stats, calibration
from edgespec.bench import mode_rows, run_modes
from edgespec.engine import Engine
from edgespec.prompt_cache import common_prefix

PROMPTS = (
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a hash map is in two sentences.",
)
GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.8, seed=1)  # llama.cpp's defaults otherwise (top-k 40, top-p 0.95, min-p 0.05)
LAYER_GAIN = 0.1  # a random layer's output against its input (rms): the stream stays the token's embedding
PYTHON_LARGE = 0.25  # a round whose Python work is this share of it is worth saying so


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


def write_model(path: Path, shape: Shape, fields: list[tuple], seed: int) -> Path:
    """A random Qwen2 model of `shape` with these tokenizer fields, written in F16 and quantized
    to Q4_K_M with llama.cpp. Its answers are known by construction: after a word (a token of a
    space and lowercase letters) comes the word a random permutation of them says, by a margin
    no float rounding can overturn. The layers are weak (LAYER_GAIN), so the stream stays its
    last token's embedding, and the output matrix is the embeddings moved to the rows of their
    successors (zero for tokens that are not words). So greedy and sampled answers agree, an
    answer's text tokenizes back to its tokens (a prediction of it is exact), a model of another
    seed is an unrelated draft (α ≈ 0), and the passes cost what the real shapes cost."""
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
    f16 = path.with_suffix(".f16.gguf")
    writer = gguf.GGUFWriter(f16, "qwen2")
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
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(path).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {f16}")
    f16.unlink()
    return path


def _words(vocab: list[str]) -> np.ndarray:
    """1 for a byte-level BPE token that is a space ("Ġ") and two or more lowercase letters, else 0."""
    return np.array(
        [len(t) > 2 and t[0] == "Ġ" and t[1:].isascii() and t[1:].isalpha() and t[1:].islower() for t in vocab],
        dtype=np.float16,
    )


# --- what the machine is --------------------------------------------------------------


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _run(["lscpu"]).splitlines() if line.startswith("Model name")),
        platform.processor(),
    )
    gpu = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]).strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": gpu or None,
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "llama_cpp_python": llama_cpp.__version__,
        "python": platform.python_version(),
        "system_info": llama_cpp.llama_print_system_info().decode(),
    }


def _run(command: list[str]) -> str:
    if shutil.which(command[0]) is None:
        return ""
    return subprocess.run(command, capture_output=True, text=True, check=False).stdout


# --- the checks -----------------------------------------------------------------------


def greedy_equality(engines: dict[str, Engine], max_tokens: int) -> list[dict]:
    """Every draft mode (and a prediction) against the target alone, token for token."""
    rows = []
    for name, engine in engines.items():
        for prompt in PROMPTS:
            alone = engine.generate(Request(prompt, GREEDY, max_tokens=max_tokens, draft_mode="off"))
            tries = [(mode, None) for mode in engine.draft_modes if mode != "off"]
            tries.append(("copy", alone.text[: len(alone.text) // 2]))  # half of the answer, as a prediction
            for mode, prediction in tries:
                request = Request(prompt, GREEDY, max_tokens=max_tokens, draft_mode=mode, prediction=prediction)
                spec = engine.generate(request)
                agreed = common_prefix(alone.tokens, spec.tokens, max(len(alone.tokens), len(spec.tokens)))
                same = None if agreed == len(alone.tokens) == len(spec.tokens) else agreed
                rows.append(
                    {
                        "engine": name,
                        "prompt": prompt[:40],
                        "mode": mode + ("+prediction" if prediction else ""),
                        "tokens": len(spec.tokens),
                        "equal": same is None,
                        "first_difference": same,
                        "acceptance_rate": round(spec.stats.acceptance_rate, 3),
                    }
                )
    return rows


def costs(engine: Engine) -> dict:
    """The calibrated curves, in seconds and in target steps."""
    verify = engine.cost_curve(engine.target)
    draft = engine.cost_curve(engine.drafter.model, calibration.DRAFT_SIZES)
    step = verify(1)
    ceiling, pass_size = verify.best_rate()
    return {
        "target_step_s": step,
        "target_tokens_per_s": 1 / step,
        "verify_steps": {k: round(verify(k) / step, 3) for k in sorted(verify.points)},
        "draft_step_s": draft(1),
        "draft_step_in_target_steps": round(draft(1) / step, 3),
        "ceiling": {"speedup": round(ceiling, 2), "pass_size": pass_size},
        "flash_attn": engine.target.flash_attn,
    }


class PassClock:
    """Seconds spent inside one model's forward passes (its eval, the logits read included: on
    a GPU that is where the pass is waited for)."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        plain = model.eval

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return plain(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        model.eval = timed


def python_share(engine: Engine, max_tokens: int) -> list[dict]:
    """Where a round's time goes, greedy and sampled, in auto and model modes: the passes, and
    the Python work around them, per round, against the target's single step."""
    target, draft = PassClock(engine.target), PassClock(engine.drafter.model)
    step = engine.cost_curve(engine.target)(1)
    rows = []
    for params, label in ((GREEDY, "greedy"), (SAMPLED, "sampled")):
        for mode in ("off", "model", "auto"):
            engine.forget()
            engine.generate(Request(PROMPTS[0], params, max_tokens=8, draft_mode=mode))  # the prefill, not counted
            target.seconds = draft.seconds = 0.0
            stats = engine.generate(Request(PROMPTS[0], params, max_tokens=max_tokens, draft_mode=mode)).stats
            rows.append(_share(label, mode, stats, target.seconds, draft.seconds, step))
    return rows


def _share(label: str, mode: str, stats: Stats, decode_target: float, draft_s: float, step: float) -> dict:
    """decode_target, draft_s: the seconds of the models' passes (the prompt was cached: all of them in rounds)."""
    rounds = max(stats.rounds, 1)
    python = max(stats.rounds_s - decode_target - draft_s, 0.0)
    sampling = max(stats.verify_s - decode_target, 0.0)
    drafting = max(stats.draft_s - draft_s, 0.0)
    return {
        "sampling": label,
        "mode": mode,
        "rounds": stats.rounds,
        "tokens_per_s": round(stats.tokens_per_s, 1),
        "round_ms": round(1e3 * stats.rounds_s / rounds, 3),
        "target_passes_ms": round(1e3 * decode_target / rounds, 3),
        "draft_passes_ms": round(1e3 * draft_s / rounds, 3),
        "python_ms": round(1e3 * python / rounds, 3),
        "python_share": round(python / stats.rounds_s, 3) if stats.rounds_s else 0.0,
        "python_in_target_steps": round(python / rounds / step, 3),
        "of_which_sampling_ms": round(1e3 * sampling / rounds, 3),
        "of_which_planning_and_drafting_ms": round(1e3 * drafting / rounds, 3),
        "of_which_rest_ms": round(1e3 * max(python - sampling - drafting, 0.0) / rounds, 3),
    }


def known_alpha_rows(engines: dict[str, Engine], max_tokens: int, repeats: int, log) -> list[dict]:
    """Bench rows where acceptance is known by construction."""
    main, twin = engines["random-draft"], engines["draft-is-target"]
    answer = main.generate(Request(PROMPTS[0], GREEDY, max_tokens=max_tokens, draft_mode="off")).text
    cases = (  # name, engine, modes, the request's prediction
        ("prediction = greedy answer (alpha 1)", main, ("off", "copy", "auto"), answer),
        ("draft model = target (alpha 1)", twin, ("off", "model", "auto"), None),
        ("random draft model (alpha ~0)", main, ("off", "model", "auto"), None),
    )
    rows = []
    for name, engine, modes, prediction in cases:

        def request_of(mode, prediction=prediction):
            gamma = 4 if mode == "model" else "auto"
            return Request(
                PROMPTS[0], GREEDY, max_tokens=max_tokens, draft_mode=mode, gamma=gamma, prediction=prediction
            )

        runs = run_modes(engine, list(modes), request_of, repeats, name[:10], log)
        row = mode_rows(name, runs)
        speedup, pass_size = engine.cost_curve(engine.target).best_rate()
        row["ceiling"] = {"speedup": round(speedup, 2), "pass_size": pass_size}
        rows.append(row)
    return rows


# --- the report -----------------------------------------------------------------------


def markdown(report: dict) -> str:
    m, c = report["machine"], report["costs"]
    built = f"llama-cpp-python built in {report['build_s']:.0f} s, " if "build_s" in report else ""
    lines = [
        "# edgespec GPU check",
        "",
        f"- machine: {m['gpu'] or 'no GPU'}; CPU {m['cpu']} ({m['cores']} cores); GPU offload {m['gpu_offload']}",
        f"- models: random weights, Qwen2.5-Coder shapes ({report['shapes']}), Q4_K_M, Qwen's tokenizer;"
        f" --gpu-layers {report['gpu_layers']}; flash attention {c['flash_attn']}",
        f"- times: {built}models written in {report['write_s']:.0f} s, loaded in {report['load_s']:.0f} s,"
        f" measuring total {report['total_s']:.0f} s",
        "",
        "## Costs",
        f"target step {1e3 * c['target_step_s']:.2f} ms ({c['target_tokens_per_s']:.0f} tok/s);"
        f" draft step {1e3 * c['draft_step_s']:.2f} ms = {c['draft_step_in_target_steps']:.2f} target steps",
        "",
        "V(k) in target steps: "
        + ", ".join(f"V({k}) = {v:.2f}" for k, v in c["verify_steps"].items())
        + f"; ceiling {c['ceiling']['speedup']:.2f}x (a perfect free draft, passes of {c['ceiling']['pass_size']})",
        "",
        "## Greedy equality with the target alone",
        "| engine | prompt | mode | tokens | equal | first difference | acceptance |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["greedy_equality"]:
        lines.append(
            f"| {r['engine']} | {r['prompt']} | {r['mode']} | {r['tokens']} | {r['equal']} |"
            f" {r['first_difference']} | {r['acceptance_rate']} |"
        )
    lines += [
        "",
        "## A round's time (per round)",
        "| sampling | mode | tok/s | round ms | target ms | draft ms | Python ms | Python share | Python in steps"
        " | sampling ms | planning+drafting ms | rest ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["python_share"]:
        lines.append(
            f"| {r['sampling']} | {r['mode']} | {r['tokens_per_s']} | {r['round_ms']} | {r['target_passes_ms']} |"
            f" {r['draft_passes_ms']} | {r['python_ms']} | {r['python_share']:.0%} | {r['python_in_target_steps']}"
            f" | {r['of_which_sampling_ms']} | {r['of_which_planning_and_drafting_ms']} | {r['of_which_rest_ms']} |"
        )
    if report["python_is_large"]:
        lines += ["", f"**Python work is a large share of a round**: {report['python_is_large']}"]
    lines += [
        "",
        "## Known acceptance (speed against the target alone, same process, median of repeats)",
        "| case | mode | tok/s | vs off | acceptance | tokens/round | mean γ | rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["known_alpha"]:
        for mode, r in row["modes"].items():
            speculation = "| | |"
            if "acceptance_rate" in r:
                speculation = f"{r['acceptance_rate']:.2f} | {r['tokens_per_round']:.2f} | {r['mean_gamma']:.1f}"
                speculation += f" | {r['rounds_by_source']}"
            lines.append(
                f"| {row['prompt']} | {mode} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {speculation} |"
            )
        lines.append(f"| {row['prompt']} | ceiling | | {row['ceiling']['speedup']:.2f}x | | | | |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="write the models, measure, report")
    run.add_argument("--out", type=Path, required=True, help="folder for report.json, report.md and the models")
    run.add_argument("--tokenizer", type=Path, required=True, help="a GGUF whose tokenizer fields the models get")
    run.add_argument("--gpu-layers", type=int, default=99)
    run.add_argument("--small", action="store_true", help="small shapes (a CPU, CI) instead of the real ones")
    run.add_argument("--max-tokens", type=int, default=128)
    run.add_argument("--repeats", type=int, default=3)
    tokenizer = commands.add_parser("tokenizer", help="keep a GGUF's tokenizer fields alone, in a small GGUF")
    tokenizer.add_argument("source", type=Path)
    tokenizer.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "tokenizer":
        write_tokenizer(args.source, args.out)
        return 0
    return check(args)


def check(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("EDGESPEC_HOME", str(args.out / "home"))  # calibrations of this run's own files only

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    shapes = SHAPES["small" if args.small else "full"]
    fields = tokenizer_fields(args.tokenizer)
    models = args.out / "models"
    models.mkdir(exist_ok=True)
    paths = {
        "target": write_model(models / "target.gguf", shapes["target"], fields, seed=0),
        "draft": write_model(models / "draft.gguf", shapes["draft"], fields, seed=1),
    }
    write_s = time.perf_counter() - start
    log(f"models written: {', '.join(f'{p.name} {p.stat().st_size >> 20} MiB' for p in paths.values())}")
    loaded = time.perf_counter()
    options = {"n_gpu_layers": args.gpu_layers, "n_ctx": 4096, "progress": False}
    engines = {
        "random-draft": edgespec.load(target=paths["target"], draft=paths["draft"], **options),
        "draft-is-target": edgespec.load(target=paths["target"], draft=paths["target"], **options),
    }
    load_s = time.perf_counter() - loaded
    log("models loaded; calibrating")
    report = {"machine": machine(), "shapes": "small" if args.small else "1.5B target, 0.5B draft"}
    report |= {"gpu_layers": args.gpu_layers, "write_s": write_s, "load_s": load_s}
    if (build_s := args.out / "build_s").is_file():  # (gpu-check.sh built llama-cpp-python first)
        report["build_s"] = float(build_s.read_text())
    report["costs"] = costs(engines["random-draft"])
    log(f"costs: {report['costs']['verify_steps']}; greedy equality")
    report["greedy_equality"] = greedy_equality(engines, args.max_tokens)
    log("python share")
    report["python_share"] = python_share(engines["random-draft"], args.max_tokens)
    large = [
        f"{r['sampling']} {r['mode']}: {r['python_ms']} ms a round, {r['python_share']:.0%} of it,"
        f" {r['python_in_target_steps']} target steps"
        for r in report["python_share"]
        if r["python_share"] >= PYTHON_LARGE
    ]
    report["python_is_large"] = "; ".join(large)
    log("known-acceptance bench rows")
    report["known_alpha"] = known_alpha_rows(engines, args.max_tokens, args.repeats, log)
    for engine in engines.values():
        engine.close()
    report["total_s"] = time.perf_counter() - start
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "report.md").write_text(markdown(report))
    shutil.rmtree(models)  # gigabytes of random weights: not worth bringing back
    print(markdown(report))
    failed = [r for r in report["greedy_equality"] if not r["equal"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
