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
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import llama_cpp
from gpu_models import SEEDS, WRITTEN

import edgespec
from edgespec import Request, SamplingParams, Stats, calibration
from edgespec.bench import mode_rows, run_modes
from edgespec.engine import Engine
from edgespec.modes import AUTO
from edgespec.prompt_cache import common_prefix

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


class PassClock:
    """Seconds spent inside one model's forward passes (its eval, the logits read included: on
    a GPU that is where the pass is waited for)."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        self.model = model
        plain = model.eval

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return plain(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        model.eval = timed

    def stop(self) -> None:
        """The model's own eval again (a model may be another's draft too: clocks must not stack)."""
        del self.model.eval


def python_share(engines: dict[str, Engine], max_tokens: int) -> list[dict]:
    """Where a round's time goes, greedy and sampled: the passes, and the Python work around
    them, per round, against the target's single step. Rounds of the target alone, of auto
    (with the unrelated draft model: it drafts nothing), and of the draft model drafting 4
    tokens that are all accepted (the draft model is the target): the most Python a round has."""
    cases = (("off", "random-draft", AUTO), ("auto", "random-draft", AUTO), ("model", "draft-is-target", 4))
    steps = {name: engine.costs.curve(engine.target)(1) for name, engine in engines.items()}  # (rounds move the curves)
    rows = []
    for params, label in ((GREEDY, "greedy"), (SAMPLED, "sampled")):
        for mode, name, gamma in cases:
            engine = engines[name]
            target, draft = PassClock(engine.target), PassClock(engine.draft_model)
            engine.forget()
            request = Request(PROMPTS[0], params, max_tokens=max_tokens, draft_mode=mode, gamma=gamma)
            engine.generate(replace(request, max_tokens=8))  # the prefill, not counted
            target.seconds = draft.seconds = 0.0
            stats = engine.generate(request).stats
            target.stop()
            draft.stop()
            rows.append(_share(label, f"{mode} γ={gamma}", stats, target.seconds, draft.seconds, steps[name]))
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
        "mode": "mode",
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


SECTIONS = {"costs": _costs, "greedy_equality": _equality, "python_share": _python_share, "known_alpha": _known_alpha}


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
        f"{r['sampling']} {r['mode']}: {r['python_ms']} ms a round, {r['python_share']:.0%} of it,"
        f" {r['python_in_target_steps']} target steps"
        for r in shares
        if r["python_share"] >= PYTHON_LARGE
    )
    save("python_share", shares)
    save("known_alpha", known_alpha_rows(engines, args.max_tokens, args.repeats, log))
    for engine in engines.values():
        engine.close()
    shutil.rmtree(args.models)  # gigabytes of random weights: not worth bringing back
    print(markdown(report))
    return 1 if any(not r["equal"] for r in report["greedy_equality"]) else 0


if __name__ == "__main__":
    sys.exit(main())
