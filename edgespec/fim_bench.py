"""The fill-in-the-middle class of `edgespec bench`: completions as an editor asks for them,
cut from real source files (modules of Python's standard library, the same on every machine
with this Python).

A case is a cursor inside a line of code: the rest of that line is cut out (the span to
complete); the request is what llama.vscode sends there: the 256 lines above as the prefix,
the cursor line up to the cursor, the 64 lines below as the suffix, two 64-line chunks of
other code (one of another module, one of the same module far from the cursor), the cursor
line's indentation as n_indent, 128 tokens at most. Each case is timed as a keystroke: the
request one character earlier is read first (prompt only, as an editor's last request left
the cache), then the case, streamed: time to its first token and to its last. An answer is
exact when its first line is the span.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from time import perf_counter

import numpy as np

from .engine import Engine
from .fim import Chunk, Infill
from .request import Request
from .sampling import SamplingParams
from .stats import Stats

FILES = ("textwrap.py", "shlex.py", "graphlib.py", "queue.py", "sched.py", "statistics.py")
PREFIX_LINES, SUFFIX_LINES, CHUNK_LINES = 256, 64, 64  # llama.vscode's defaults
MAX_TOKENS = 128  # llama.vscode's n_predict
MIN_SPAN = 4  # characters left to complete, at least
CASES = 12
NAME = "fim"  # the class's name among bench's prompt classes


@dataclass(frozen=True)
class FimCase:
    name: str  # file:line
    infill: Infill  # the request at the cursor
    span: str  # what was cut out: the rest of the cursor line
    indent: int  # the cursor line's indentation (llama.vscode's n_indent)

    @property
    def keystroke_before(self) -> Infill:
        """The request one character earlier (the last keystroke's)."""
        return replace(self.infill, cursor_line=self.infill.cursor_line[:-1])

    def request(self, draft_mode: str, *, keystroke_before: bool = False) -> Request:
        """The case's greedy request (the one before it: the prompt only, as a warm-up reads it)."""
        return Request(
            self.keystroke_before if keystroke_before else self.infill,
            SamplingParams(temperature=0),
            max_tokens=0 if keystroke_before else MAX_TOKENS,
            min_indent=self.indent,
            draft_mode=draft_mode,
        )

    def exact(self, answer: str) -> bool:
        return answer.split("\n", 1)[0].rstrip() == self.span.rstrip()

    def body(self) -> dict:
        """The case as llama.vscode's /infill body (greedy, one answer; its time limit left out)."""
        infill = self.infill
        return {
            "input_prefix": infill.prefix,
            "input_suffix": infill.suffix,
            "input_extra": [{"text": c.text, "filename": c.filename} for c in infill.chunks],
            "prompt": infill.cursor_line,
            "n_predict": MAX_TOKENS,
            "n_indent": self.indent,
            "temperature": 0,
            "samplers": ["temperature"],
            "cache_prompt": True,
            "stream": True,
        }


def cases(count: int = CASES, seed: int = 0) -> list[FimCase]:
    """`count` cursors in FILES, drawn with `seed`: each in a one-line statement (code, not a
    docstring or comment) with MIN_SPAN or more characters after it."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    sources = {name: (folder / name).read_text(encoding="utf-8") for name in FILES}
    files = {name: text.splitlines() for name, text in sources.items()}
    statements = {
        name: sorted({n.lineno - 1 for n in ast.walk(ast.parse(text)) if _code(n) and n.end_lineno == n.lineno})
        for name, text in sources.items()
    }
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        name = rng.choice(FILES)
        lines = files[name]
        at = rng.choice(statements[name])
        line = lines[at]
        indent = len(line) - len(line.lstrip())
        if len(line.strip()) < 2 * MIN_SPAN or any(c.name == f"{name}:{at + 1}" for c in out):
            continue
        col = rng.randrange(indent + 1, len(line) - MIN_SPAN + 1)
        other = rng.choice([f for f in FILES if f != name])
        start = rng.randrange(max(1, len(files[other]) - CHUNK_LINES))
        chunks = [Chunk("\n".join(files[other][start : start + CHUNK_LINES]) + "\n", other)]
        far = [i for i in range(0, len(lines) - CHUNK_LINES, CHUNK_LINES) if abs(i - at) > PREFIX_LINES]
        if far:
            i = rng.choice(far)
            chunks.append(Chunk("\n".join(lines[i : i + CHUNK_LINES]) + "\n", name))
        infill = Infill(
            "\n".join(lines[max(0, at - PREFIX_LINES) : at]) + "\n",
            "\n" + "\n".join(lines[at + 1 : at + 1 + SUFFIX_LINES]) + "\n",
            line[:col],
            chunks,
        )
        out.append(FimCase(f"{name}:{at + 1}", infill, line[col:], indent))
    return out


def _code(node: ast.AST) -> bool:
    """A statement that is code: not a docstring (a string standing alone)."""
    docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    return isinstance(node, ast.stmt) and not docstring


@dataclass
class Completion:
    """One timed completion: seconds from the request to its first token and to its end."""

    first_s: float
    last_s: float
    exact: bool
    stats: Stats


def complete(engine: Engine, case: FimCase, mode: str) -> Completion:
    """The case as a keystroke in `mode`: the cache as the last keystroke's request left it
    (read untimed), then the case streamed and timed."""
    engine.forget()
    engine.generate(case.request(mode, keystroke_before=True))
    engine.upkeep()
    start, first, text = perf_counter(), None, []
    for event in engine.stream(case.request(mode)):
        if event.token is not None and first is None:
            first = perf_counter() - start
        text.append(event.text)
    last = perf_counter() - start
    engine.upkeep()
    return Completion(last if first is None else first, last, case.exact("".join(text)), event.stats)


def run_fim(engine: Engine, modes: Sequence[str], repeats: int, log: Callable[[str], None], count: int = CASES) -> dict:
    """Each mode on `count` cases, alternating the order of the modes from case to case; per
    mode the p50 and p90 of the time to the first token and to the last, the exact-match rate,
    the prompt tokens a keystroke read, and the rounds by draft source; each mode's p50 to the
    last token against the target alone's ("off")."""
    runs: dict[str, list[Completion]] = {m: [] for m in modes}
    flip = False
    for r in range(repeats):
        for case in cases(count):
            for mode in modes[::-1] if flip else modes:
                done = complete(engine, case, mode)
                runs[mode].append(done)
                log(
                    f"  {NAME:<10} {mode:<6} run {r + 1} {case.name}: first token {done.first_s * 1000:.0f} ms,"
                    f" last {done.last_s * 1000:.0f} ms, {done.stats.n_tokens} tokens, exact {done.exact}"
                )
            flip = not flip
    rows = {mode: _row(done) for mode, done in runs.items()}
    for row in rows.values():
        row["vs_off_p50"] = row["last_p50_ms"] / rows["off"]["last_p50_ms"]
    return {"prompt": NAME, "cases": count, "repeats": repeats, "modes": rows}


def _row(done: list[Completion]) -> dict:
    first = np.array([d.first_s for d in done]) * 1000
    last = np.array([d.last_s for d in done]) * 1000
    total = Stats.combine([d.stats for d in done])
    return {
        "first_p50_ms": float(np.percentile(first, 50)),
        "first_p90_ms": float(np.percentile(first, 90)),
        "last_p50_ms": float(np.percentile(last, 50)),
        "last_p90_ms": float(np.percentile(last, 90)),
        "exact": sum(d.exact for d in done) / len(done),
        "prompt_read": float(np.mean([d.stats.n_prompt - d.stats.n_prompt_cached for d in done])),
        "tokens": float(np.mean([d.stats.n_tokens for d in done])),
        "acceptance_rate": total.acceptance_rate,
        "rounds_by_source": total.rounds_by_source,
    }


def print_rows(report: dict) -> None:
    print(
        f"{NAME}: {report['cases']} completions x {report['repeats']} repeats, each after its last keystroke's"
        " request; times in ms from the request"
    )
    print(
        f"{'mode':<7}{'first p50':>10}{'p90':>7}{'last p50':>10}{'p90':>7}{'vs off':>8}{'exact':>7}"
        f"{'read':>6}{'tokens':>8}{'alpha':>7}  rounds"
    )
    for mode, m in report["modes"].items():
        print(
            f"{mode:<7}{m['first_p50_ms']:>10.0f}{m['first_p90_ms']:>7.0f}{m['last_p50_ms']:>10.0f}"
            f"{m['last_p90_ms']:>7.0f}{m['vs_off_p50']:>7.2f}x{m['exact']:>7.0%}{m['prompt_read']:>6.0f}"
            f"{m['tokens']:>8.1f}{m['acceptance_rate']:>7.2f}  "
            + ", ".join(f"{source} {n}" for source, n in sorted(m["rounds_by_source"].items()))
        )
