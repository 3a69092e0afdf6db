"""The fill-in-the-middle class of `edgespec bench`: an editor's typing session. A few lines of
real source files (modules of Python's standard library, the same on every machine with this
Python) are taken out and typed again, one character at a time, each line's indentation given (an
editor indents after Enter). Every keystroke sends what llama.vscode sends (its /infill body: the
256 lines above, the cursor line up to the cursor, the rest of the line and the 64 lines below, two
64-line chunks of other code, n_indent, n_predict 128, t_max_predict_ms 500, its samplers and three
answers, n_cmpl), seeded so that runs repeat. Per keystroke: seconds from the request to the first
token, to the first line of the first answer (what an editor shows) and to all three answers (what
llama.vscode waits for); whether that first line is the rest of the real line; the prompt tokens
read. The user types a key every KEY_S seconds (the next request goes when the last answer is in,
as llama.vscode sends it) and pauses ENTER_PAUSE_S after Enter; the requests go to an EngineThread,
which works idle in those gaps, as the server's does. Each session begins with its first request read untimed
(an editor's warm-up, as after opening the file).

scripts/fim_side_by_side.py sends the same requests over HTTP to `edgespec serve` and llama-server.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter, sleep

import numpy as np

from ..engine import Engine
from ..engine_thread import EngineThread
from ..fim import Chunk, Infill
from ..server.llama_api import answers_of, request_of
from ..stats import Stats

FILES = ("textwrap.py", "shlex.py", "graphlib.py", "queue.py", "sched.py", "statistics.py")
PREFIX_LINES, SUFFIX_LINES, CHUNK_LINES = 256, 64, 64  # llama.vscode's defaults
LLAMA_VSCODE = {  # llama.vscode's request, its defaults (../shared/clients/llama-vscode-infill.json)
    "n_predict": 128,
    "n_cmpl": 3,
    "top_k": 40,
    "top_p": 0.99,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 500,
}
SESSIONS = 2
LINES = 2  # lines typed per session
KEY_S = 0.25  # a keystroke this often (typing at 4 characters a second)
ENTER_PAUSE_S = 1.0  # the pause after Enter
NAME = "fim"  # the class's name among bench's prompt classes


@dataclass(frozen=True)
class Keystroke:
    """A request as typed: the text at the cursor, the rest of the real line, its indentation."""

    infill: Infill
    rest: str  # what the user will type on this line: the first line of a right answer
    indent: int
    after_enter: bool  # the line's first keystroke (its indentation given), after Enter
    seed: int

    def body(self) -> dict:
        """llama.vscode's /infill body for this keystroke (seeded; streamed, to time its first token)."""
        infill = self.infill
        return LLAMA_VSCODE | {
            "input_prefix": infill.prefix,
            "input_suffix": infill.suffix,
            "input_extra": [{"text": c.text, "filename": c.filename} for c in infill.chunks],
            "prompt": infill.cursor_line,
            "n_indent": self.indent,
            "seed": self.seed,
            "stream": True,
        }

    def right(self, answer: str) -> bool:
        """Whether the answer's first line is the rest of the real line."""
        return answer.split("\n", 1)[0].rstrip() == self.rest.rstrip()


@dataclass(frozen=True)
class Session:
    name: str  # file:first line typed
    keystrokes: list[Keystroke]


def sessions(count: int = SESSIONS, seed: int = 0, lines: int = LINES) -> list[Session]:
    """`count` sessions in FILES, drawn with `seed`: each types `lines` consecutive one-line
    statements of code (not docstrings or comments) again, from their indentation on."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    sources = {name: (folder / name).read_text(encoding="utf-8") for name in FILES}
    files = {name: text.splitlines() for name, text in sources.items()}
    statements = {
        name: {n.lineno - 1 for n in ast.walk(ast.parse(text)) if _code(n) and n.end_lineno == n.lineno}
        for name, text in sources.items()
    }
    rng = random.Random(seed)
    out: list[Session] = []
    while len(out) < count:
        name = rng.choice(FILES)
        text = files[name]
        at = rng.choice(sorted(statements[name]))
        block = range(at, at + lines)
        if not all(i in statements[name] and len(text[i].strip()) > 3 for i in block) or name in [
            s.name.split(":")[0] for s in out
        ]:
            continue
        other = rng.choice([f for f in FILES if f != name])
        start = rng.randrange(max(1, len(files[other]) - CHUNK_LINES))
        chunks = [Chunk("\n".join(files[other][start : start + CHUNK_LINES]) + "\n", other)]
        far = [i for i in range(0, len(text) - CHUNK_LINES, CHUNK_LINES) if abs(i - at) > PREFIX_LINES]
        if far:
            i = rng.choice(far)
            chunks.append(Chunk("\n".join(text[i : i + CHUNK_LINES]) + "\n", name))
        below = "\n" + "\n".join(text[at + lines : at + lines + SUFFIX_LINES]) + "\n"  # after the lines typed
        keystrokes = []
        for i in block:
            line = text[i]
            indent = len(line) - len(line.lstrip())
            prefix = "\n".join(text[max(0, i - PREFIX_LINES) : i]) + "\n"  # the lines above, typed ones too
            for col in range(indent, len(line)):
                infill = Infill(prefix, below, line[:col], chunks)
                keystrokes.append(Keystroke(infill, line[col:], indent, col == indent and i > at, rng.randrange(2**31)))
        out.append(Session(f"{name}:{at + 1}", keystrokes))
    return out


def _code(node: ast.AST) -> bool:
    """A statement that is code: not a docstring (a string standing alone)."""
    docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    return isinstance(node, ast.stmt) and not docstring


@dataclass
class Timed:
    """One keystroke's answers: seconds from the request to the first token, to the first answer's
    first line, and to the last answer's end; whether that line was right; the first answer's stats."""

    first_s: float
    line_s: float
    whole_s: float
    right: bool
    after_enter: bool
    stats: Stats


def type_session(engine: Engine, session: Session, mode: str, log: Callable[[str], None]) -> list[Timed]:
    """The session's keystrokes in `mode`, each as the server answers llama.vscode's body (its
    answers one after another) on an EngineThread, which works idle while the typist pauses."""
    engine.forget()
    warm_up = session.keystrokes[0].body() | {"n_predict": 0}
    engine.generate(request_of(warm_up, infill=True))
    engine.upkeep()
    thread = EngineThread()
    thread.engine = engine
    timed, keystrokes = [], session.keystrokes
    try:
        for keystroke, following in zip(keystrokes, [*keystrokes[1:], None], strict=True):
            done = thread.submit(_answer, engine, keystroke, mode, perf_counter()).result()
            timed.append(done)
            log(
                f"  {NAME:<6} {mode:<5} {session.name} {keystroke.infill.cursor_line.strip()[-24:]!r:>28}: first"
                f" {done.first_s * 1000:5.0f} ms, line {done.line_s * 1000:5.0f} ms, all {done.whole_s * 1000:5.0f}"
                f" ms, read {done.stats.n_prompt - done.stats.n_prompt_cached}, right {done.right}"
            )
            sleep(max(0.0, ENTER_PAUSE_S if following is not None and following.after_enter else KEY_S - done.whole_s))
    finally:
        thread.close()
    return timed


def _answer(engine: Engine, keystroke: Keystroke, mode: str, start: float) -> Timed:
    """The keystroke's answers, timed from `start` (when the request was sent)."""
    body = keystroke.body() | {"draft_mode": mode}
    request, count = request_of(body, infill=True), answers_of(body)
    first, line, stats, previous, texts = None, None, None, "", []
    for index in range(count):
        text = []
        for event in engine.stream(request.answer(index, previous, perf_counter() - start)):
            text.append(event.text)
            if index == 0 and first is None and event.token is not None:
                first = perf_counter() - start
            if index == 0 and line is None and (event.done or "\n" in event.text):
                line = perf_counter() - start
        previous = "".join(text)
        texts.append(previous)
        stats = stats or event.stats
    whole = perf_counter() - start
    return Timed(first or line, line, whole, keystroke.right(texts[0]), keystroke.after_enter, stats)


def run_fim(
    engine: Engine,
    modes: Sequence[str],
    repeats: int,
    log: Callable[[str], None],
    count: int = SESSIONS,
    keystrokes: int | None = None,
) -> dict:
    """`count` sessions (drawn anew for each repeat; their first `keystrokes` only, if given) in
    each mode, the order of the modes alternating from session to session; per mode the p50 and
    p90 of each time, of the whole answer after Enter, how often the first line was right, the
    prompt tokens a keystroke read, the rounds by draft source; each mode's p50 of the whole
    answer against the target alone's ("off")."""
    runs: dict[str, list[Timed]] = {m: [] for m in modes}
    flip = False
    for r in range(repeats):
        for session in sessions(count, seed=r):
            session = Session(session.name, session.keystrokes[:keystrokes])
            for mode in modes[::-1] if flip else modes:
                runs[mode] += type_session(engine, session, mode, log)
            flip = not flip
    rows = {mode: _row(done) for mode, done in runs.items()}
    for row in rows.values():
        row["vs_off_p50"] = row["whole_p50_ms"] / rows["off"]["whole_p50_ms"]
    return {"prompt": NAME, "sessions": count * repeats, "keystrokes": len(runs[modes[0]]), "modes": rows}


def percentiles(name: str, seconds: Iterable[float]) -> dict:
    """p50 and p90 of times in seconds, in ms."""
    ms = np.array(list(seconds)) * 1000
    return {f"{name}_p50_ms": float(np.percentile(ms, 50)), f"{name}_p90_ms": float(np.percentile(ms, 90))}


def _row(done: list[Timed]) -> dict:
    total = Stats.combine([d.stats for d in done])
    row = {}
    for name in ("first", "line", "whole"):
        row |= percentiles(name, (getattr(d, f"{name}_s") for d in done))
    row |= percentiles("enter_whole", [d.whole_s for d in done if d.after_enter] or [0.0])
    return row | {
        "right": sum(d.right for d in done) / len(done),
        "prompt_read": float(np.mean([d.stats.n_prompt - d.stats.n_prompt_cached for d in done])),
        "tokens": float(np.mean([d.stats.n_tokens for d in done])),
        "acceptance_rate": total.acceptance_rate,
        "rounds_by_source": total.rounds_by_source,
    }


def print_rows(report: dict) -> None:
    print(
        f"{NAME}: {report['keystrokes']} keystrokes in {report['sessions']} typing sessions, llama.vscode's request"
        " (3 answers); ms from the request to the first token, the first answer's first line and all answers"
    )
    print(
        f"{'mode':<7}{'first p50':>10}{'p90':>7}{'line p50':>9}{'p90':>7}{'all p50':>8}{'p90':>7}{'vs off':>8}"
        f"{'Enter p90':>10}{'right':>7}{'read':>6}{'alpha':>7}  rounds"
    )
    for mode, m in report["modes"].items():
        print(
            f"{mode:<7}{m['first_p50_ms']:>10.0f}{m['first_p90_ms']:>7.0f}{m['line_p50_ms']:>9.0f}{m['line_p90_ms']:>7.0f}"
            f"{m['whole_p50_ms']:>8.0f}{m['whole_p90_ms']:>7.0f}{m['vs_off_p50']:>7.2f}x{m['enter_whole_p90_ms']:>10.0f}"
            f"{m['right']:>7.0%}{m['prompt_read']:>6.1f}{m['acceptance_rate']:>7.2f}  "
            + ", ".join(f"{source} {n}" for source, n in sorted(m["rounds_by_source"].items()))
        )
