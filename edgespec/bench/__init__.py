"""`edgespec bench`: each draft mode against the target alone, in one process.

All modes run greedy on the same engine, their order rotated, so they share the
machine's state (heat, caches, other load); speed is reported as a ratio to the
target-alone ("off") runs of the same prompt: the median over repeats of the
ratio within each repeat. A class with a JSON schema runs every mode under it (so
"off" is the constrained target alone) and also runs the target without it
("no-grammar"), which prices the grammar itself.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from time import perf_counter

import numpy as np

from .. import calibration
from ..engine import Engine
from ..errors import EdgespecError
from ..kernels import plain_llama
from ..memory import DEFAULT_MEMORY_MB
from ..modes import AUTO, DraftMode
from ..registry import tomllib
from ..request import Request
from ..sampling import SamplingParams
from ..stats import Stats
from . import concurrency, editors, repeated_work, round_time

PROMPTS_FILE = Path(__file__).with_name("prompts.toml")
MODES = (DraftMode.OFF, DraftMode.MODEL, DraftMode.COPY, DraftMode.HYBRID, DraftMode.AUTO)  # OFF: the target alone
FIXED_GAMMA = 3  # the "model" mode's draft length unless --gamma says otherwise
GREEDY = SamplingParams(temperature=0)
UNCONSTRAINED = "no-grammar"  # a schema class's target alone, without its schema
CHAINS = "chains"  # auto with chains of drafts only, where the target verifies trees (to price them)
# what a speculating mode's row reports of its runs' combined Stats
SPECULATION = (
    "acceptance_rate",
    "tokens_per_round",
    "mean_gamma",
    "drafting_share",
    "expected_tokens_per_round",
    "rounds_by_source",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
    "tree_rounds",
    "mean_tree_size",
)


def load_prompts() -> list[dict]:
    """The prompt classes; one with `prediction_from` sends the code block of another
    class's prompt (the file being edited) as the predicted output, with `prediction_replace`
    done to it (a prediction a little off); with `prediction_is_answer`, the target's own answer
    is the prediction instead (made when the class runs)."""
    prompts = tomllib.loads(PROMPTS_FILE.read_text())["prompt"]
    by_name = {p["name"]: p for p in prompts}
    for p in prompts:
        if source := p.get("prediction_from"):
            p["text"] = by_name[source]["text"]
            p["prediction"] = re.search(r"```\w*\n(.*?)```", p["text"], flags=re.S).group(1)
            if replace := p.get("prediction_replace"):
                p["prediction"] = p["prediction"].replace(*replace)
    return prompts


def check_selection(modes: Sequence[str], prompts: Sequence[str] | None) -> None:
    """Refuse unknown mode or prompt-class names (before any model is loaded)."""
    classes = [p["name"] for p in load_prompts()]
    classes += [editors.NAME, round_time.NAME, concurrency.NAME, repeated_work.NAME]
    for name in modes:
        if name not in MODES:
            raise EdgespecError(f"unknown bench mode '{name}'; use some of {', '.join(MODES)}")
    for name in prompts or ():
        if name not in classes:
            raise EdgespecError(f"unknown bench prompt class '{name}'; use some of {', '.join(classes)}")


def run_bench(
    engine: Engine,
    *,
    repeats: int = 1,
    max_tokens: int = 256,
    gamma: int | None = None,
    progress: bool = True,
    llama_baseline: bool = False,
    modes: Sequence[str] = MODES,
    prompts: Sequence[str] | None = None,
    memory_mb: int | None = DEFAULT_MEMORY_MB,
) -> dict:
    """modes: which of MODES to run ("off", the baseline, always runs); prompts: which
    classes (default: all; fill-in-the-middle where the target has the tokens for it; the
    Python per round, round_time, requests at once, concurrency, and work that repeats
    across requests, repeated_work, only when named). memory_mb: the repeat class's memories'
    cap (None: its memory way left out). The engine's own memory, if any, is left out of
    every run (answers of one mode would draft another's)."""
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    check_selection(modes, prompts)
    kept, engine.memory = engine.memory, None
    try:
        return _run_bench(engine, repeats, max_tokens, gamma, log, llama_baseline, modes, prompts, memory_mb)
    finally:
        engine.memory = kept


def _run_bench(engine, repeats, max_tokens, gamma, log, llama_baseline, modes, prompts, memory_mb) -> dict:
    if editors.NAME in (prompts or ()):
        engine.prompts.fim_tokens()  # a target without them is told so before any calibration
    if concurrency.NAME in (prompts or ()):
        concurrency.check_engine(engine)
    modes = [m for m in MODES if m is DraftMode.OFF or (m in modes and m in engine.draft_modes)]
    draft_modes = list(modes)  # the typing sessions' and concurrent requests' modes: no chains or llama rows
    if DraftMode.AUTO in modes and engine.target.can_branch:
        modes.append(CHAINS)
    if llama_baseline:
        modes.append("llama")
    fixed_gamma = gamma or FIXED_GAMMA
    start = perf_counter()
    verify_curve = engine.costs.curve(engine.target)  # calibrates now if this machine has no cached curve
    draft_curve = engine.costs.draft_step(engine.drafter)  # the draft model's, or the target's heads'
    spread = engine.costs.spread(engine.target)  # with --parallel: what a pass over several sequences costs
    calibration_s = perf_counter() - start
    raw = engine.target.chat_template() is None  # a base model: the prompts as plain text
    engine.generate(Request("Hello", GREEDY, max_tokens=8, raw=raw))  # warm-up: first decodes are slow
    engine.upkeep()
    llama = _LlamaBaseline(engine) if llama_baseline else None

    rows = []
    for prompt in [p for p in load_prompts() if not prompts or p["name"] in prompts]:
        schema = prompt.get("json_schema")
        class_modes = modes + [UNCONSTRAINED] if schema else modes

        if prompt.get("prediction_is_answer"):  # (greedy: the answer of every mode)
            answer = engine.generate(
                _request(DraftMode.OFF, prompt=prompt, raw=raw, max_tokens=max_tokens, gamma=fixed_gamma)
            )
            prompt = prompt | {"prediction": answer.text}
        request_of = partial(_request, prompt=prompt, raw=raw, max_tokens=max_tokens, gamma=fixed_gamma)
        runs = run_modes(engine, class_modes, request_of, repeats, prompt["name"], log, llama)
        rows.append(mode_rows(prompt["name"], runs) | {"ceiling": _ceiling(verify_curve)})
        if DraftMode.AUTO in runs:
            rows[-1] |= _against_best_fixed(rows[-1]["modes"])
        if CHAINS in runs:
            rows[-1]["auto_vs_chains"] = _paired(rows[-1]["modes"], DraftMode.AUTO, CHAINS)
    fim = None
    if editors.NAME in (prompts or ()) or (not prompts and not engine.target.fim.missing()):
        fim = editors.run_fim(engine, draft_modes, repeats, log)
    rounds = round_time.run_rounds(engine, repeats, log) if round_time.NAME in (prompts or ()) else None
    repeat = None
    if repeated_work.NAME in (prompts or ()):
        repeat = repeated_work.run_repeat(engine, max_tokens, repeats, log, memory_mb)
    concurrent = None
    if concurrency.NAME in (prompts or ()):
        concurrent = concurrency.run_concurrent(engine, draft_modes, repeats, max_tokens, log)
    return {
        "target": engine.target.path.name,
        "draft": engine.draft_name,
        "n_threads": engine.target.n_threads,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "model_gamma": fixed_gamma,
        "calibration_s": calibration_s,
        "flash_attn": engine.target.flash_attn,
        "repack": engine.target.repack,
        "raw_prompts": raw,
        "verify_cost_steps": {k: verify_curve(k) / verify_curve(1) for k in sorted(verify_curve.points)},
        "draft_step_cost": draft_curve(1) / verify_curve(1) if draft_curve else None,
        "batch_spread": spread.factors or None,
        "rollback": _rollback(engine, verify_curve),
        "prompts": rows,
        "fim": fim,
        "rounds": rounds,
        "concurrent": concurrent,
        "repeat": repeat,
    }


def _request(mode: str, *, prompt: dict, raw: bool, max_tokens: int, gamma: int) -> Request:
    """A prompt class's greedy request in `mode` (the model mode with a fixed γ; a class with a
    schema under it, except for the target alone without it)."""
    schema = prompt.get("json_schema")
    return Request(
        prompt["text"],
        GREEDY,
        max_tokens=max_tokens,
        raw=raw,
        draft_mode=DraftMode.AUTO
        if mode == CHAINS
        else mode
        if mode in MODES
        else DraftMode.OFF,  # (llama: its prompt)
        gamma=gamma if mode is DraftMode.MODEL else AUTO,
        trees=mode != CHAINS,
        prediction=prompt.get("prediction"),
        json_schema=schema if mode != UNCONSTRAINED else None,
    )


def run_modes(
    engine: Engine,
    modes: Sequence[str],
    request_of: Callable[[str], Request],
    repeats: int,
    name: str,
    log: Callable[[str], None],
    llama: _LlamaBaseline | None = None,
) -> dict[str, list]:
    """Each mode's runs of its request (request_of(mode)), the order of the modes rotated
    between repeats, so that over as many repeats as modes each has run first, second, ... once
    (reversed, the middle one always ran second: auto against chains, the same rounds, read
    0.93-0.97x in three sessions here, and 0.99-1.00x rotated); every run evaluates its prompt
    afresh, so prefill is timed too."""
    runs: dict[str, list] = {m: [] for m in modes}
    for r in range(repeats):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            engine.forget()
            request = request_of(mode)
            if mode == "llama":
                runs[mode].append(llama.run(engine.prompt_tokens(request), request.max_tokens))
                continue
            stats = engine.generate(request).stats
            engine.upkeep()  # between runs, as an idle engine would: not inside the next one's timing
            runs[mode].append(stats)
            log(f"  {name:<10} {mode:<6} run {r + 1}: {stats.n_tokens} tokens, {stats.tokens_per_s:6.2f} tok/s")
    return runs


def _rollback(engine: Engine, unit: calibration.CostCurve) -> dict:
    """How each model's cache is cut back, and on a recurrent model what a checkpoint and a
    restore cost here, in target steps (after a rejection the kept tokens are evaluated again too)."""
    report = {"kind": engine.target.cache.rollback.value, "snapshots": engine.target.n_snapshots}
    for role, model in (("target", engine.target), ("draft", engine.draft_model)):
        if model is not None and (cost := engine.costs.rollback(model)) is not None:
            steps = {"checkpoint": cost.checkpoint_s / unit(1), "restore": cost.restore_s / unit(1)}
            report[f"{role}_steps"] = steps
    return report


def _ceiling(curve: calibration.CostCurve) -> dict:
    """What a perfect free drafter could reach with the curve measured so far: k tokens
    per pass of k, at the best k (in target steps, i.e. a speedup)."""
    speedup, k = curve.best_rate()
    return {"speedup": speedup, "pass_size": k}


def _against_best_fixed(modes: dict) -> dict:
    """The best fixed mode of the class (off counts) and auto's ratio to it: the median over
    repeats of the ratio within each repeat (the two ran minutes apart at most, under the
    same load; medians taken apart would compare different moments' noise)."""
    fixed = {m: row["speedup"] for m, row in modes.items() if m not in ("auto", "llama", UNCONSTRAINED, CHAINS)}
    best = max(fixed, key=fixed.get)
    return {"best_fixed": best, "auto_vs_best_fixed": _paired(modes, DraftMode.AUTO, best)}


def _paired(modes: dict, mode: str, other: str) -> float:
    """`mode`'s speed against `other`'s: the median over repeats of the ratio within each repeat."""
    ratios = [a / b for a, b in zip(modes[mode]["speedups"], modes[other]["speedups"], strict=True)]
    return float(np.median(ratios))


def mode_rows(name: str, runs: dict) -> dict:
    """Per mode: tokens/s over all repeats, its ratio to off in each repeat and their median,
    prefill tokens/s, and what speculation did."""

    def rate(samples):
        return sum(s.n_tokens for s in samples) / sum(s.decode_s for s in samples)

    out = {"prompt": name, "modes": {}}
    for mode, samples in runs.items():
        ratios = [rate([mine]) / rate([off]) for mine, off in zip(samples, runs["off"], strict=True)]
        row = {"tokens_per_s": rate(samples), "speedup": float(np.median(ratios)), "speedups": ratios}
        row["prefill_tokens_per_s"] = sum(s.n_prompt for s in samples) / sum(s.prefill_s for s in samples)
        row["first_token_s"] = float(np.median([s.first_token_s for s in samples]))
        if mode not in ("off", "llama", UNCONSTRAINED):
            total = Stats.combine(samples).as_dict()
            row |= {key: total[key] for key in SPECULATION}
            row["tokens_by_source"] = {k: n / len(samples) for k, n in total["tokens_by_source"].items()}  # per answer
        out["modes"][mode] = row
    return out


class _LlamaBaseline:
    """llama-cpp-python's own high-level generation on the same target file and
    threads: the yardstick for our target-alone loop."""

    def __init__(self, engine: Engine) -> None:
        t = self.target = engine.target
        self.llm = plain_llama(
            t.path,
            t.repack,
            n_ctx=t.n_ctx,
            n_threads=t.n_threads,
            n_threads_batch=t.n_threads,
            flash_attn=t.flash_attn,
            verbose=False,
        )

    def run(self, tokens: list[int], max_tokens: int) -> LlamaRun:
        """Greedy tokens; prefill is the time to the first token, decode from it to the last."""
        n, first, last = 0, 0.0, 0.0
        self.llm.reset()  # or it would reuse the prompt it evaluated last time: prefill is timed too
        start = perf_counter()
        for token in self.llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            if self.target.is_eog(token) or n + 1 > max_tokens:
                break
            n += 1
            last = perf_counter()
            first = first or last
        # the first token's own step is in the prefill: the decode rate is over the other n-1
        return LlamaRun(n, (last - first) * n / max(n - 1, 1), len(tokens), first - start)


@dataclass
class LlamaRun:
    """One run of the llama-cpp-python baseline, in Stats' terms."""

    n_tokens: int
    decode_s: float
    n_prompt: int
    prefill_s: float

    @property
    def first_token_s(self) -> float:  # (its prefill is timed to the first token)
        return self.prefill_s


def print_report(report: dict) -> None:
    print(
        f"target {report['target']}  draft {report['draft']}  threads {report['n_threads']}  "
        f"{report['max_tokens']} tokens x {report['repeats']} repeats, greedy; model mode gamma "
        f"{report['model_gamma']}, other modes gamma auto"
        + ("; no chat template: prompts sent as plain text" if report["raw_prompts"] else "")
    )
    curve = report["verify_cost_steps"]
    print(
        f"calibration ({report['calibration_s']:.1f}s, flash attention {'on' if report['flash_attn'] else 'off'},"
        f" repack {'on' if report['repack'] else 'off'}):"
        " V(k) in target steps: " + " ".join(f"{k}:{v:.2f}" for k, v in curve.items())
    )
    if report["draft_step_cost"] is not None:
        print(f"draft step: {report['draft_step_cost']:.2f} target steps")
    if report["batch_spread"]:
        factors = " ".join(f"{n}:{factor:.2f}" for n, factor in sorted(report["batch_spread"].items()))
        print(f"a pass spread over n sequences, against one sequence's: {factors}")
    rollback = report["rollback"]
    if rollback["kind"] != "truncate":
        line = f"rollback: {rollback['kind']}"
        if rollback["snapshots"]:
            line += f" (a pass cut back by up to {rollback['snapshots']} tokens for free, longer by checkpoint)"
        for role in ("target", "draft"):
            if steps := rollback.get(f"{role}_steps"):
                line += f"; {role} checkpoint {steps['checkpoint']:.2f}, restore {steps['restore']:.2f} target steps"
        print(line + "; after a rejection the kept tokens ride in the next pass")
    if report["prompts"]:  # (none where only fim or rounds were asked for)
        print(
            f"{'prompt':<16}{'mode':<7}{'tok/s':>8}{'vs off':>9}{'prefill':>9}{'1st ms':>8}{'alpha':>7}"
            f"{'tok/round':>10}{'mean γ':>8}{'E[n]':>7}  rounds"
        )
    for row in report["prompts"]:
        ceiling = row["ceiling"]
        print(
            f"{row['prompt']:<16}ceiling {ceiling['speedup']:.2f}x"
            f" (a perfect free draft, passes of {ceiling['pass_size']})"
        )
        for mode, m in row["modes"].items():
            line = f"{row['prompt']:<16}{mode:<7}{m['tokens_per_s']:>8.2f}{m['speedup']:>8.2f}x"
            line += f"{m['prefill_tokens_per_s']:>9.1f}{m['first_token_s'] * 1e3:>8.0f}"
            if "acceptance_rate" in m:
                line += (
                    f"{m['acceptance_rate']:>7.2f}{m['tokens_per_round']:>10.2f}{m['mean_gamma']:>8.1f}"
                    f"{m['expected_tokens_per_round']:>7.2f}  "
                    + ", ".join(f"{source} {n}" for source, n in m["rounds_by_source"].items())
                )
                by_source = ", ".join(f"{k} {v:.0f}" for k, v in m["tokens_by_source"].items())
                line += f"; tokens/answer: {by_source}"
                if m["accepted_prediction_tokens"] or m["rejected_prediction_tokens"]:
                    line += f" prediction +{m['accepted_prediction_tokens']}/-{m['rejected_prediction_tokens']}"
                if m["tree_rounds"]:
                    line += f"; {m['tree_rounds']} trees of {m['mean_tree_size']:.1f} tokens"
            print(line)
        if "best_fixed" in row:
            print(
                f"{row['prompt']:<16}auto is {row['auto_vs_best_fixed']:.2f}x the best fixed mode ({row['best_fixed']})"
            )
        if "auto_vs_chains" in row:
            print(
                f"{row['prompt']:<16}auto (trees where they pay) is {row['auto_vs_chains']:.2f}x auto with chains only"
            )
    if report["fim"]:
        editors.print_rows(report["fim"])
    if report["rounds"]:
        round_time.print_rows(report["rounds"])
    if report["concurrent"]:
        concurrency.print_rows(report["concurrent"])
    if report["repeat"]:
        repeated_work.print_rows(report["repeat"])
