"""The repeat class of `edgespec bench`: work that repeats across requests, where the memory
(memory.py) drafts what earlier requests wrote. Three cases, each greedy unless said:

- regenerate: one prompt answered, then asked again (the regenerated answer is timed), greedy
  and sampled (another seed: another answer, drawn from the same law);
- extractions: twenty similar extraction prompts, as a script sends them, each answered after
  the last (the whole job is timed, and the twentieth alone);
- restart: five extractions, the memory saved and read back as the next process would, then
  five others (the second session is timed).

Per case, three ways, their order rotated between repeats: the target alone (`off`), auto with
the memory left out (`no-memory`), and auto with it (`memory`: a memory of the case's own, empty
at its start; in restart, the one the first session left on disk). The user's own memory is never
read or written. Only where asked for (--prompts repeat)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..engine import Engine
from ..memory import Memory, vocabulary_id
from ..modes import DraftMode
from ..request import Request
from ..sampling import SamplingParams
from ..stats import Stats

NAME = "repeat"
WAYS = ("off", "no-memory", "memory")
REGENERATE = "Write a Python function that merges two sorted lists into one sorted list, with a docstring and tests."
EXTRACT = (
    "Extract the order below as JSON with the keys customer, city, product, quantity, total_usd and date"
    " (YYYY-MM-DD). Answer with the JSON alone.\n\nOrder {n}: {customer} from {city} ordered {quantity} x"
    " {product} on {day} {month} 2026, paying ${total}."
)
CUSTOMERS = ("Ada Byron", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth",
             "Frances Allen", "John Backus", "Radia Perlman", "Ken Thompson")  # fmt: skip
CITIES = ("Lisbon", "Oslo", "Denver", "Kyoto", "Nairobi", "Porto", "Quebec", "Tallinn", "Austin", "Perth")
PRODUCTS = ("USB-C hub", "mechanical keyboard", "27-inch monitor", "laptop stand", "webcam", "desk lamp",
            "noise-cancelling headset", "external SSD", "ergonomic mouse", "docking station")  # fmt: skip
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October")
JOB = 20  # extractions in the job
SESSION = 5  # extractions per session of the restart case


@dataclass(frozen=True)
class Case:
    name: str
    warm_up: list[Request]  # what the memory holds before the timed requests (answered with it on)
    timed: list[Request]
    restart: bool = False  # the memory saved and read back between the two


def extraction(n: int) -> str:
    pick = np.random.default_rng(n)
    return EXTRACT.format(
        n=1000 + n,
        customer=CUSTOMERS[pick.integers(len(CUSTOMERS))],
        city=CITIES[pick.integers(len(CITIES))],
        quantity=int(pick.integers(1, 9)),
        product=PRODUCTS[pick.integers(len(PRODUCTS))],
        day=int(pick.integers(1, 29)),
        month=MONTHS[pick.integers(len(MONTHS))],
        total=f"{pick.integers(20, 900)}.{pick.integers(0, 100):02d}",
    )


GREEDY = SamplingParams(temperature=0)
SEEDED = (SamplingParams(seed=1), SamplingParams(seed=2))  # llama.cpp's default sampling: two answers


def cases(max_tokens: int, raw: bool) -> list[Case]:
    def ask(prompt: str, params: SamplingParams = GREEDY) -> Request:
        return Request(prompt, params, max_tokens=max_tokens, raw=raw)

    job = [ask(extraction(n)) for n in range(JOB)]
    return [
        Case("regenerate greedy", [ask(REGENERATE)], [ask(REGENERATE)]),
        Case("regenerate sampled", [ask(REGENERATE, SEEDED[0])], [ask(REGENERATE, SEEDED[1])]),
        Case("extractions", [], job),
        Case("restart", job[:SESSION], [ask(extraction(n)) for n in range(JOB, JOB + SESSION)], restart=True),
    ]


def run_repeat(
    engine: Engine, max_tokens: int, repeats: int, log: Callable[[str], None], memory_mb: int | None
) -> dict:
    """Each case in each way, `repeats` times; per case and way the timed requests' stats.
    memory_mb: the cap of the cases' memories (None: the memory way is left out)."""
    vocabulary = vocabulary_id(engine.target)
    raw = engine.target.chat_template() is None
    ways = WAYS if memory_mb is not None else WAYS[:2]
    kept, rows = engine.memory, []
    try:
        for case in cases(max_tokens, raw):
            runs: dict[str, list[list[Stats]]] = {way: [] for way in ways}
            for r in range(repeats):
                for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
                    with tempfile.TemporaryDirectory() as folder:
                        engine.memory = Memory(vocabulary, folder=Path(folder), cap_mb=memory_mb or 1, source="bench")
                        runs[way].append(_run(engine, case, way))
                    stats = Stats.combine(runs[way][-1])
                    log(f"  {NAME:<10} {case.name:<20} {way:<9} run {r + 1}: {stats.tokens_per_s:6.2f} tok/s")
            rows.append(_row(case.name, runs))
    finally:
        engine.memory = kept
    return {"cases": rows, "memory_mb": memory_mb}


def _run(engine: Engine, case: Case, way: str) -> list[Stats]:
    """The case's timed requests in one way, each from an empty KV cache (prefill timed too); in
    the memory way, after the warm-up requests (and where the case restarts, the memory saved
    and read back from its file)."""
    memory = engine.memory
    for request in case.warm_up if way == "memory" else ():
        engine.forget()
        engine.generate(request)
    if case.restart and way == "memory":
        memory.save()
        engine.memory = Memory(memory.vocabulary, folder=memory.path.parent, cap_mb=memory.cap_mb, source="bench")
    mode = DraftMode.OFF if way == "off" else DraftMode.AUTO
    timed = []
    for request in case.timed:
        engine.forget()
        timed.append(engine.generate(replace(request, draft_mode=mode, memory=way == "memory")).stats)
        engine.upkeep()
    return timed


def _row(name: str, runs: dict[str, list[list[Stats]]]) -> dict:
    """Per way: tokens/s of the timed requests, their ratio to off (the median over repeats of the
    ratio within each), tokens per target pass; of the last request alone too (the twentieth)."""

    def rate(stats: list[Stats]) -> float:
        return sum(s.n_tokens for s in stats) / sum(s.decode_s for s in stats)

    row = {"case": name, "ways": {}}
    for way, samples in runs.items():
        whole = [rate(s) / rate(off) for s, off in zip(samples, runs["off"], strict=True)]
        last = [rate(s[-1:]) / rate(off[-1:]) for s, off in zip(samples, runs["off"], strict=True)]
        total = Stats.combine([s for sample in samples for s in sample])
        row["ways"][way] = {
            "tokens_per_s": rate([s for sample in samples for s in sample]),
            "speedup": float(np.median(whole)),
            "last_speedup": float(np.median(last)),
            "tokens_per_pass": total.tokens_per_round,
            "memory_tokens": total.accepted_by_source.get("memory", 0) / len(samples),
            "recall_ms_per_round": 1e3 * total.recall_s / max(total.rounds, 1),
            "rounds_by_source": total.rounds_by_source,
        }
    return row


def print_rows(report: dict) -> None:
    print("repeat: work that repeats across requests (the memory way: a memory of its own, the user's untouched)")
    header = f"{'case':<20}{'way':<11}{'tok/s':>8}{'vs off':>8}{'last':>8}{'tok/pass':>10}"
    print(header + f"{'from memory':>13}{'lookup':>10}")
    for row in report["cases"]:
        for way, w in row["ways"].items():
            print(
                f"{row['case']:<20}{way:<11}{w['tokens_per_s']:>8.2f}{w['speedup']:>7.2f}x{w['last_speedup']:>7.2f}x"
                f"{w['tokens_per_pass']:>10.2f}{w['memory_tokens']:>13.0f}{w['recall_ms_per_round']:>8.3f}ms"
            )
