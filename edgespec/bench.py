"""`edgespec bench`: speculative decoding against the target alone, in one process.

Both modes run greedy on the same engine, alternating, so they share the
machine's state (thermal, caches, other load); speed is reported as a ratio.
"""

from __future__ import annotations

import sys
from pathlib import Path
from time import perf_counter

from .engine import Engine
from .errors import EdgespecError
from .registry import tomllib

PROMPTS_FILE = Path(__file__).with_name("bench_prompts.toml")


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens/round] = (1 - α^(γ+1)) / (1 - α) for i.i.d. acceptance rate α."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def load_prompts() -> list[dict]:
    return tomllib.loads(PROMPTS_FILE.read_text())["prompt"]


def run_bench(engine: Engine, *, repeats: int = 1, max_tokens: int = 256, progress: bool = True,
              llama_baseline: bool = False) -> dict:  # fmt: skip
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    if engine.drafter is None:
        raise EdgespecError("bench compares speculation with the target alone: give a pair or a --draft model")
    engine.generate("Hello", temperature=0, max_tokens=8)  # warm-up: first decodes are slow
    llama = _LlamaBaseline(engine) if llama_baseline else None
    rows, totals = [], {"none": [0, 0.0], "spec": [0, 0.0], "llama": [0, 0.0]}
    for prompt in load_prompts():
        runs = {"none": [], "spec": [], "llama": []}
        for r in range(repeats):
            order = ["none", "spec"] if r % 2 == 0 else ["spec", "none"]
            for mode in order + (["llama"] if llama else []):
                if mode == "llama":
                    n, seconds = llama.run(engine.prompt_tokens(prompt["text"]), max_tokens)
                    runs[mode].append((n, seconds, None))
                else:
                    stats = engine.generate(prompt["text"], speculative=mode == "spec", temperature=0,
                                            max_tokens=max_tokens).stats  # fmt: skip
                    runs[mode].append((stats.n_tokens, stats.decode_s, stats))
                n, seconds, _ = runs[mode][-1]
                totals[mode][0] += n
                totals[mode][1] += seconds
                log(f"  {prompt['name']:<11} {mode:<5} run {r + 1}: {n} tokens, {n / seconds:6.2f} tok/s")
        rows.append(_row(prompt["name"], runs, engine.gamma))
    overall = {mode: n / s for mode, (n, s) in totals.items() if s > 0}
    report = {
        "target": engine.target.path.name,
        "draft": engine.drafter.model.path.name if hasattr(engine.drafter, "model") else type(engine.drafter).__name__,
        "gamma": engine.gamma,
        "n_threads": engine.target.n_threads,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "prompts": rows,
        "overall": {
            "none_tokens_per_s": overall["none"],
            "spec_tokens_per_s": overall["spec"],
            "speedup": overall["spec"] / overall["none"],
        },
    }
    if llama:
        report["overall"]["llama_cpp_python_tokens_per_s"] = overall["llama"]
        report["overall"]["none_vs_llama_cpp_python"] = overall["none"] / overall["llama"]
    return report


def _row(name: str, runs: dict, gamma: int) -> dict:
    rate = lambda mode: sum(n for n, _, _ in runs[mode]) / sum(s for _, s, _ in runs[mode])
    spec = [s for _, _, s in runs["spec"]]
    drafted, accepted, rounds = (sum(getattr(s, k) for s in spec) for k in ("drafted", "accepted", "rounds"))
    alpha = accepted / drafted if drafted else 0.0
    row = {
        "prompt": name,
        "none_tokens_per_s": rate("none"),
        "spec_tokens_per_s": rate("spec"),
        "speedup": rate("spec") / rate("none"),
        "acceptance_rate": alpha,
        "tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0,
        "expected_tokens_per_round": expected_tokens_per_round(alpha, gamma),
        "n_tokens": sum(s.n_tokens for s in spec) / len(spec),
    }
    if runs["llama"]:
        row["llama_cpp_python_tokens_per_s"] = rate("llama")
    return row


class _LlamaBaseline:
    """llama-cpp-python's own high-level generation on the same target file and
    threads: the yardstick for our target-alone loop."""

    def __init__(self, engine: Engine) -> None:
        from llama_cpp import Llama

        t = self.target = engine.target
        self.llm = Llama(model_path=str(t.path), n_ctx=t.n_ctx, n_threads=t.n_threads, n_threads_batch=t.n_threads,
                         verbose=False)  # fmt: skip

    def run(self, tokens: list[int], max_tokens: int) -> tuple[int, float]:
        """Greedy tokens and seconds from the first to the last token (prefill excluded)."""
        n, first = 0, None
        for token in self.llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            if self.target.is_eog(token) or n + 1 > max_tokens:
                break
            n += 1
            if first is None:
                first = perf_counter()
            last = perf_counter()
        # the first token's time is unknown (it comes with prefill): rate over the other n-1
        return n, (last - first) * n / max(n - 1, 1)


def print_report(report: dict) -> None:
    print(f"target {report['target']}  draft {report['draft']}  gamma {report['gamma']}  "
          f"threads {report['n_threads']}  {report['max_tokens']} tokens x {report['repeats']} repeats, greedy")  # fmt: skip
    llama = "llama_cpp_python_tokens_per_s" in report["overall"]
    head = f"{'prompt':<12}{'none tok/s':>11}{'spec tok/s':>11}{'speedup':>9}{'alpha':>7}{'tok/round':>10}{'E[n]':>7}"
    print(head + (f"{'llama-cpp-python':>18}" if llama else ""))
    for r in report["prompts"]:
        line = (f"{r['prompt']:<12}{r['none_tokens_per_s']:>11.2f}{r['spec_tokens_per_s']:>11.2f}{r['speedup']:>8.2f}x"
                f"{r['acceptance_rate']:>7.2f}{r['tokens_per_round']:>10.2f}{r['expected_tokens_per_round']:>7.2f}")  # fmt: skip
        print(line + (f"{r['llama_cpp_python_tokens_per_s']:>18.2f}" if llama else ""))
    o = report["overall"]
    print(f"{'overall':<12}{o['none_tokens_per_s']:>11.2f}{o['spec_tokens_per_s']:>11.2f}{o['speedup']:>8.2f}x")
    if llama:
        print(f"target-alone vs llama-cpp-python's Llama: {o['none_vs_llama_cpp_python']:.3f}x")
