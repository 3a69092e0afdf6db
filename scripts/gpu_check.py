"""The GPU check's measurements (scripts/gpu-check.sh builds llama.cpp, then runs this).

Random-weight models with the real shapes of the default pair (Qwen2.5-Coder 1.5B target,
0.5B draft) and Qwen's real tokenizer (gpu_models.py), quantized as the registry's files are (Q4_K_M), so a
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

    python scripts/gpu_check.py --out DIR --models DIR [--gpu-layers 99]   # after gpu_models.py write --out DIR
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
from gpu_models import SEEDS, WRITTEN

import edgespec
from edgespec import Request, SamplingParams, calibration
from edgespec.bench import mode_rows, run_modes
from edgespec.bench.round_time import python_per_round
from edgespec.engine import Engine
from edgespec.kernels import choose_repack
from edgespec.modes import AUTO
from edgespec.prompt_cache import common_prefix
from edgespec.sampling import Law, law

PROMPTS = (
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a hash map is in two sentences.",
)
GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.8, seed=1)  # llama.cpp's defaults otherwise (top-k 40, top-p 0.95, min-p 0.05)
PYTHON_LARGE = 0.25  # a round whose Python work is this share of it is worth saying so


def quantize(f16: Path, out: Path) -> Path:
    """`f16` in Q4_K_M, as the registry's files are (the F16 file is removed)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {f16}")
    f16.unlink()
    return out


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
    verify = engine.costs.curve(engine.target)
    draft = engine.costs.curve(engine.draft_model, calibration.DRAFT_SIZES)
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


def python_share(engines: dict[str, Engine], max_tokens: int) -> list[dict]:
    """Where a round's time goes, greedy and sampled (round_time.py): rounds of the target alone,
    of auto (with the unrelated draft model: it drafts nothing), and of the draft model drafting 4
    tokens that are all accepted (the draft model is the target): the most Python a round has."""
    cases = (("off", "random-draft", AUTO), ("auto", "random-draft", AUTO), ("model", "draft-is-target", 4))
    rows = []
    for params, label in ((GREEDY, "greedy"), (SAMPLED, "sampled")):
        for mode, name, gamma in cases:
            request = Request(PROMPTS[0], params, max_tokens=max_tokens, draft_mode=mode, gamma=gamma)
            rows.append({"sampling": label} | python_per_round(engines[name], request, f"{mode} γ={gamma}"))
    return rows


def backend_sampling(path: Path, gpu_layers: int, tries: int = 20) -> dict:
    """llama.cpp's backend samplers (experimental; llama_cpp 0.3.36 has them): a context whose
    outputs are each row's top-k candidates (ids and logits), chosen where the model runs, so
    that whole rows of logits are neither copied back nor searched, against a context that
    returns whole rows. Exact for us wherever top-k is on: law() on a row's top-k candidates is
    its law on the vocabulary. For a single-token pass (a draft step, a plain step) and a verify
    pass of 5 tokens: whether llama.cpp takes it, the pass with its laws each way (median of
    `tries`, alternating), and whether the candidates give the rows' own laws."""
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = gpu_layers
    # the kernels edgespec runs here: on an AMX Xeon the repacked ones crash the process (kernels.py)
    model_params.use_extra_bufts = choose_repack(path, os.cpu_count() or 1, gpu_layers)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(SAMPLED.top_k))
    configs = (llama_cpp.llama_sampler_seq_config * 1)()
    configs[0].seq_id, configs[0].sampler = 0, ctypes.cast(chain, ctypes.c_void_p)
    prefix = (llama_cpp.llama_token * 16)(*range(100, 116))  # a cache to attend to

    def context(backend: bool):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 256, 64, 64, 1
        if backend:
            params.samplers, params.n_samplers = configs, 1
        ctx = llama_cpp.llama_init_from_model(model, params)
        if not ctx or llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(prefix, len(prefix))) != 0:
            raise RuntimeError("llama.cpp made no context with a backend sampler, or it could not read a prompt")
        return ctx

    def timed_pass(ctx, rows: int, read) -> tuple[float, list]:
        batch = llama_cpp.llama_batch_init(rows, 0, 1)
        for i in range(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = 200 + i, len(prefix) + i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = rows
        start = time.perf_counter()
        status = llama_cpp.llama_decode(ctx, batch)
        laws = read(ctx, rows) if status == 0 else None
        seconds = time.perf_counter() - start
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, len(prefix), -1)
        if status != 0:
            raise RuntimeError(f"llama_decode refused a pass of {rows} tokens, all with outputs (status {status})")
        return seconds, laws

    def whole_rows(ctx, rows: int) -> list:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(rows, n_vocab))
        return [law(row, SAMPLED) for row in logits]

    def backend_laws(ctx, rows: int) -> list:
        laws = []
        for i in range(rows):
            n = llama_cpp.llama_get_sampled_candidates_count_ith(ctx, i)
            if n == 0 or n != llama_cpp.llama_get_sampled_logits_count_ith(ctx, i):
                raise RuntimeError(f"row {i} came back with {n} candidates")
            ids = np.ctypeslib.as_array(llama_cpp.llama_get_sampled_candidates_ith(ctx, i), shape=(n,))
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_sampled_logits_ith(ctx, i), shape=(n,))
            local = law(logits, SAMPLED)  # over the candidates' own indices
            tokens = ids[local.ids].astype(np.int64)
            order = np.argsort(tokens)
            laws.append(Law(tokens[order], local.probs[order]))
        return laws

    def measure(contexts, rows: int) -> dict:
        try:
            times: dict[str, list[float]] = {"whole_rows": [], "backend_top_k": []}
            for _ in range(tries):
                seconds, plain = timed_pass(contexts[0], rows, whole_rows)
                times["whole_rows"].append(seconds)
                seconds, sampled = timed_pass(contexts[1], rows, backend_laws)
                times["backend_top_k"].append(seconds)
        except RuntimeError as error:  # (0.3.36 logs why: backend sampling takes one output per sequence)
            return {"rows": rows, "works": False, "why": str(error)}
        same = all(
            np.array_equal(a.ids, b.ids) and np.allclose(a.probs, b.probs, atol=1e-3)
            for a, b in zip(plain, sampled, strict=True)
        )
        medians = {name: float(np.median(t)) for name, t in times.items()}
        return {
            "rows": rows,
            "works": True,
            "exact": same,
            "pass_ms": {name: round(1e3 * t, 3) for name, t in medians.items()},
            "saves_ms": round(1e3 * (medians["whole_rows"] - medians["backend_top_k"]), 3),
        }

    contexts = []
    try:
        contexts = [context(False), context(True)]
        return {"top_k": SAMPLED.top_k, "passes": [measure(contexts, rows) for rows in (1, 5)]}
    except RuntimeError as error:
        return {"top_k": SAMPLED.top_k, "passes": [], "why": str(error)}
    finally:
        for ctx in contexts:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_sampler_free(chain)
        llama_cpp.llama_model_free(model)


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
        speedup, pass_size = engine.costs.curve(engine.target).best_rate()
        row["ceiling"] = {"speedup": round(speedup, 2), "pass_size": pass_size}
        rows.append(row)
    return rows


# --- the report -----------------------------------------------------------------------


def markdown(report: dict) -> str:
    """The report as Markdown: the sections measured so far."""
    m = report["machine"]
    built = f"llama-cpp-python built in {report['build_s']:.0f} s, " if "build_s" in report else ""
    lines = [
        "# edgespec GPU check",
        "",
        f"- machine: {m['gpu'] or 'no GPU'}; CPU {m['cpu']} ({m['cores']} cores); GPU offload {m['gpu_offload']}",
        f"- models: random weights, Qwen2.5-Coder shapes ({report['shapes']}), Q4_K_M, Qwen's tokenizer;"
        f" --gpu-layers {report['gpu_layers']}",
        f"- times: {built}models written in {report['write_s']:.0f} s, quantized and loaded in"
        f" {report['load_s']:.0f} s, measuring total {report['total_s']:.0f} s",
    ]
    for section, write in SECTIONS.items():
        if section in report:
            lines += ["", *write(report)]
    return "\n".join(lines) + "\n"


def _costs(report: dict) -> list[str]:
    c = report["costs"]
    return [
        "## Costs",
        f"target step {1e3 * c['target_step_s']:.2f} ms ({c['target_tokens_per_s']:.0f} tok/s);"
        f" draft step {1e3 * c['draft_step_s']:.2f} ms = {c['draft_step_in_target_steps']:.2f} target steps;"
        f" flash attention {c['flash_attn']}",
        "",
        "V(k) in target steps: "
        + ", ".join(f"V({k}) = {v:.2f}" for k, v in c["verify_steps"].items())
        + f"; ceiling {c['ceiling']['speedup']:.2f}x (a perfect free draft, passes of {c['ceiling']['pass_size']})",
    ]


def _table(title: str, columns: list[str], rows: list[list]) -> list[str]:
    """A Markdown table under a heading."""
    return [
        f"## {title}",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(map(str, row)) + " |" for row in rows),
    ]


def _equality(report: dict) -> list[str]:
    keys = ("engine", "prompt", "mode", "tokens", "equal", "first_difference", "acceptance_rate")
    rows = [[r[key] for key in keys] for r in report["greedy_equality"]]
    columns = ["engine", "prompt", "mode", "tokens", "equal", "first difference", "acceptance"]
    return _table("Greedy equality with the target alone", columns, rows)


def _python_share(report: dict) -> list[str]:
    columns = {
        "sampling": "sampling",
        "case": "mode",
        "tokens_per_s": "tok/s",
        "round_ms": "round ms",
        "target_passes_ms": "target ms",
        "draft_passes_ms": "draft ms",
        "python_ms": "Python ms",
        "python_share": "Python share",
        "python_in_target_steps": "Python in steps",
        "of_which_sampling_ms": "sampling ms",
        "of_which_planning_and_drafting_ms": "planning+drafting ms",
        "of_which_rest_ms": "rest ms",
    }
    rows = [[f"{r[key]:.0%}" if key == "python_share" else r[key] for key in columns] for r in report["python_share"]]
    lines = _table("A round's time (per round)", list(columns.values()), rows)
    if report["python_is_large"]:
        lines += ["", f"**Python work is a large share of a round**: {report['python_is_large']}"]
    return lines


def _known_alpha(report: dict) -> list[str]:
    rows = []
    for case in report["known_alpha"]:
        for mode, r in case["modes"].items():
            speculation = ["", "", "", ""]
            if "acceptance_rate" in r:
                speculation = [
                    f"{r['acceptance_rate']:.2f}",
                    f"{r['tokens_per_round']:.2f}",
                    f"{r['mean_gamma']:.1f}",
                    r["rounds_by_source"],
                ]
            rows.append([case["prompt"], mode, f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x", *speculation])
        rows.append([case["prompt"], "ceiling", "", f"{case['ceiling']['speedup']:.2f}x", "", "", "", ""])
    columns = ["case", "mode", "tok/s", "vs off", "acceptance", "tokens/round", "mean γ", "rounds"]
    return _table("Known acceptance (speed against the target alone, same process, median of repeats)", columns, rows)


def _backend_sampling(report: dict) -> list[str]:
    b = report["backend_sampling"]
    lines = [f"## llama.cpp's backend samplers (top-{b['top_k']} on the backend, the rest of the chain ours)"]
    if not b["passes"]:
        return lines + [f"do not work here: {b['why']}"]
    for p in b["passes"]:
        if not p["works"]:
            lines.append(f"- a pass of {p['rows']} tokens: {p['why']}")
            continue
        lines.append(
            f"- a pass of {p['rows']} tokens with its laws: {p['pass_ms']['whole_rows']} ms reading whole rows,"
            f" {p['pass_ms']['backend_top_k']} ms reading the candidates (saves {p['saves_ms']} ms);"
            f" the same laws: {p['exact']}"
        )
    return lines


SECTIONS = {
    "costs": _costs,
    "greedy_equality": _equality,
    "python_share": _python_share,
    "backend_sampling": _backend_sampling,
    "known_alpha": _known_alpha,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for report.json and report.md")
    parser.add_argument("--models", type=Path, required=True, help="where gpu_models.py wrote the F16 models")
    parser.add_argument("--gpu-layers", type=int, default=99)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    start = time.perf_counter()
    os.environ.setdefault("EDGESPEC_HOME", str(args.out / "home"))  # calibrations of this run's own files only

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    written = json.loads((args.models / WRITTEN).read_text())
    paths = {role: quantize(args.models / f"{role}.f16.gguf", args.models / f"{role}.gguf") for role in SEEDS}
    log(f"models quantized: {', '.join(f'{p.name} {p.stat().st_size >> 20} MiB' for p in paths.values())}")
    options = {"n_gpu_layers": args.gpu_layers, "n_ctx": 4096, "progress": False}
    engines = {
        "random-draft": edgespec.load(target=paths["target"], draft=paths["draft"], **options),
        "draft-is-target": edgespec.load(target=paths["target"], draft=paths["target"], **options),
    }
    report = {"machine": machine(), "shapes": "small" if written["small"] else "1.5B target, 0.5B draft"}
    report |= {"gpu_layers": args.gpu_layers, "write_s": written["seconds"], "load_s": time.perf_counter() - start}
    if (build_s := args.out / "build_s").is_file():  # (gpu-check.sh built llama-cpp-python first)
        report["build_s"] = float(build_s.read_text())

    def save(section: str, figures) -> None:
        """Each section as soon as it is measured: a run cut short still brings back what it had."""
        report[section] = figures
        report["total_s"] = time.perf_counter() - start
        (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
        (args.out / "report.md").write_text(markdown(report))
        log(f"{section} measured")

    save("costs", costs(engines["random-draft"]))
    save("greedy_equality", greedy_equality(engines, args.max_tokens))
    shares = python_share(engines, args.max_tokens)
    report["python_is_large"] = "; ".join(
        f"{r['sampling']} {r['case']}: {r['python_ms']} ms a round, {r['python_share']:.0%} of it,"
        f" {r['python_in_target_steps']} target steps"
        for r in shares
        if r["python_share"] >= PYTHON_LARGE
    )
    save("python_share", shares)
    save("backend_sampling", backend_sampling(paths["target"], args.gpu_layers))
    save("known_alpha", known_alpha_rows(engines, args.max_tokens, args.repeats, log))
    for engine in engines.values():
        engine.close()
    shutil.rmtree(args.models)  # gigabytes of random weights: not worth bringing back
    print(markdown(report))
    return 1 if any(not r["equal"] for r in report["greedy_equality"]) else 0


if __name__ == "__main__":
    sys.exit(main())
