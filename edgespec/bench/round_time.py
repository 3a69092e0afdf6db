"""The rounds class of `edgespec bench`: what a round costs in Python beside the models'
passes (sampling and acceptance, planning and drafting, bookkeeping), per round, in
milliseconds and in target steps. A GPU's step takes a few milliseconds (so do small models'
steps on a CPU): this is the share of a round that no faster model takes away.

Four cases on one prompt: the target alone, greedy and sampled (llama.cpp's default chain:
temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); the draft model at γ 4, sampled; a copy
at γ 4, sampled, from a prediction that is the sampled answer itself (a seeded answer does not
depend on drafting, so the copies hold, unless a batched pass's logits differ from a single
step's enough to move a draw: gemma-3-270m's do by up to 0.8 on a CPU). Only where asked for
(--prompts rounds)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import itemgetter
from time import perf_counter

from ..engine import Engine
from ..model import Model
from ..modes import DraftMode
from ..request import Request
from ..sampling import SamplingParams
from ..stats import Stats

NAME = "rounds"  # the class's name among bench's prompt classes
PROMPT = "Write a Python function that merges two sorted lists into one sorted list."
GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(seed=1)  # llama.cpp's defaults otherwise
GAMMA = 4
MAX_TOKENS = 128


@dataclass(frozen=True)
class RoundCase:
    name: str
    params: SamplingParams
    mode: DraftMode
    predicted: bool = False  # the sampled answer itself as the prediction


CASES = (
    RoundCase("greedy plain", GREEDY, DraftMode.OFF),
    RoundCase("sampled plain", SAMPLED, DraftMode.OFF),
    RoundCase(f"sampled model γ={GAMMA}", SAMPLED, DraftMode.MODEL),
    RoundCase(f"sampled copy γ={GAMMA}", SAMPLED, DraftMode.COPY, predicted=True),
)


class PassClock:
    """Seconds spent inside one model's forward passes (its eval, the logits read included: on
    a GPU that is where the pass is waited for)."""

    def __init__(self, model: Model) -> None:
        self.seconds = 0.0
        self.model = model
        plain = model.eval

        def timed(*args, **kwargs):
            start = perf_counter()
            try:
                return plain(*args, **kwargs)
            finally:
                self.seconds += perf_counter() - start

        model.eval = timed

    def stop(self) -> None:
        """The model's own eval again (a model may be another's draft too: clocks must not stack)."""
        del self.model.eval


def python_per_round(engine: Engine, request: Request, case: str) -> dict:
    """One run of `request` (its prompt read beforehand, not counted), and where its rounds' time
    went: the passes, and the Python around them (sampling and acceptance: the verify part that is
    not the target's pass; planning and drafting: the draft part that is not the draft model's)."""
    step = engine.costs.curve(engine.target)(1)
    engine.forget()
    engine.generate(replace(request, max_tokens=8))  # the prefill, not counted
    models = [m for m in (engine.target, engine.draft_model) if m is not None]
    clocks = [PassClock(m) for m in dict.fromkeys(models)]  # (a draft model may be the target's own file, not object)
    try:
        stats = engine.generate(request).stats
    finally:
        for clock in clocks:
            clock.stop()
    target_s = clocks[0].seconds
    draft_s = sum(c.seconds for c in clocks[1:])
    return _row(case, stats, target_s, draft_s, step)


def _row(case: str, stats: Stats, target_s: float, draft_s: float, step: float) -> dict:
    rounds = max(stats.rounds, 1)
    python = max(stats.rounds_s - target_s - draft_s, 0.0)
    sampling = max(stats.verify_s - target_s, 0.0)
    drafting = max(stats.draft_s - draft_s, 0.0)
    return {
        "case": case,
        "rounds": stats.rounds,
        "tokens_per_s": round(stats.tokens_per_s, 1),
        "round_ms": round(1e3 * stats.rounds_s / rounds, 3),
        "target_passes_ms": round(1e3 * target_s / rounds, 3),
        "draft_passes_ms": round(1e3 * draft_s / rounds, 3),
        "python_ms": round(1e3 * python / rounds, 3),
        "python_share": round(python / stats.rounds_s, 3) if stats.rounds_s else 0.0,
        "python_in_target_steps": round(python / rounds / step, 3),
        "of_which_sampling_ms": round(1e3 * sampling / rounds, 3),
        "of_which_planning_and_drafting_ms": round(1e3 * drafting / rounds, 3),
        "of_which_rest_ms": round(1e3 * max(python - sampling - drafting, 0.0) / rounds, 3),
    }


def run_rounds(engine: Engine, repeats: int, log: Callable[[str], None]) -> dict:
    """Each case `repeats` times; per case the run whose Python per round is the median."""
    raw = engine.target.chat_template() is None
    prediction = engine.generate(Request(PROMPT, SAMPLED, max_tokens=MAX_TOKENS, draft_mode="off", raw=raw)).text
    rows = []
    for case in CASES:
        if case.mode is DraftMode.MODEL and engine.drafter is None:
            continue
        request = Request(
            PROMPT,
            case.params,
            max_tokens=MAX_TOKENS,
            draft_mode=case.mode,
            gamma=GAMMA,
            raw=raw,
            prediction=prediction if case.predicted else None,
        )
        runs = [python_per_round(engine, request, case.name) for _ in range(repeats)]
        runs.sort(key=itemgetter("python_ms"))
        rows.append(runs[(len(runs) - 1) // 2])
        log(f"  {NAME:<10} {case.name:<20} {rows[-1]['python_ms']:.3f} ms of Python a round")
    return {"vocabulary": engine.target.n_vocab, "cases": rows}


def print_rows(report: dict) -> None:
    print(f"rounds: Python per round beside the passes ({report['vocabulary']}-token vocabulary)")
    print(f"{'case':<22}{'rounds':>7}{'round ms':>10}{'passes ms':>11}{'Python ms':>11}{'share':>7}{'in steps':>10}")
    for r in report["cases"]:
        passes = r["target_passes_ms"] + r["draft_passes_ms"]
        print(
            f"{r['case']:<22}{r['rounds']:>7}{r['round_ms']:>10.2f}{passes:>11.2f}{r['python_ms']:>11.3f}"
            f"{r['python_share']:>7.0%}{r['python_in_target_steps']:>10.3f}"
        )
