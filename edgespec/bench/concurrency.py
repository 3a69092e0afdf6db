"""The concurrent class of `edgespec bench`: several requests at once, as a server's scheduler
runs them (scheduler.py, driven here on the bench's own thread), against the same requests
one after the other. Three cases, each greedy, in each mode, the modes alternating:

- infill during a chat: an editor's /infill sent once a long chat answer has begun; its
  latency (request to last token) against the same /infill on an idle engine;
- 2 chats, 4 chats: sent together; the time until all are answered against the same chats
  one after the other, and the tokens per second of all of them.

Latencies are medians over the repeats. Only where asked for (--prompts concurrent); the
engine needs --parallel 4 (4 chats) or 2 (the rest)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from ..engine import Engine
from ..errors import EdgespecError
from ..fim import Infill
from ..passes import Pass
from ..request import Request
from ..scheduler import Scheduler, Task

NAME = "concurrent"
CHATS = (
    "Write a long story about a dragon who learns to program.",
    "Explain in detail how a hash map works, with an example in Python.",
    "Describe the water cycle for a ten-year-old, step by step.",
    "Write a Python class for a bank account with deposits, withdrawals and a history.",
)
INFILL = Infill(
    prefix='def mean(values):\n    """The arithmetic mean of a non-empty list."""\n    ',
    suffix="\n\n\ndef median(values):\n    ordered = sorted(values)\n",
)
INFILL_TOKENS = 32
INFILL_AFTER = 16  # chat tokens streamed before the /infill is sent


@dataclass
class Served:
    """One request's answer under the scheduler: when it was sent, answered, and its tokens."""

    request: Request
    sent: float = 0.0
    done: float = 0.0
    tokens: int = 0

    @property
    def latency(self) -> float:
        return self.done - self.sent


@dataclass
class Arrival:
    """A request sent once request `after` (an index) has `after_tokens` tokens; None: at once."""

    request: Request
    interactive: bool = False
    after: int | None = None
    after_tokens: int = 0
    served: Served = field(init=False)

    def __post_init__(self) -> None:
        self.served = Served(self.request)


def serve(engine: Engine, arrivals: Sequence[Arrival]) -> float:
    """The arrivals answered by one Scheduler (as `edgespec serve` answers them, without HTTP);
    returns the seconds until all were answered."""
    scheduler = Scheduler(engine.decode, engine.sequences.count)
    start, waiting = perf_counter(), list(arrivals)
    while waiting or scheduler.running or scheduler.waiting:
        for arrival in list(waiting):
            if arrival.after is None or arrivals[arrival.after].served.tokens >= arrival.after_tokens:
                waiting.remove(arrival)
                arrival.served.sent = perf_counter()
                scheduler.add(Task(Future(), _answer, (engine, arrival.served), arrival.interactive))
        scheduler.step()
    return perf_counter() - start


def _answer(engine: Engine, served: Served) -> Iterator[Pass]:
    for step in engine.steps(engine.start(served.request)):
        if isinstance(step, Pass):
            yield step
        elif step.done:
            served.done = perf_counter()
        else:
            served.tokens += 1


def one_after_another(engine: Engine, requests: Sequence[Request]) -> list[Served]:
    """Each request answered alone, in turn."""
    answered = []
    for request in requests:
        arrival = Arrival(request)
        serve(engine, [arrival])
        answered.append(arrival.served)
    return answered


def _chat(text: str, mode: str, max_tokens: int) -> Request:
    return Request.of([{"role": "user", "content": text}], temperature=0, max_tokens=max_tokens, draft_mode=mode)


def _infill(mode: str) -> Request:
    return Request.of(INFILL, temperature=0, max_tokens=INFILL_TOKENS, draft_mode=mode)


def check_engine(engine: Engine) -> None:
    if engine.sequences.count < 2:
        raise EdgespecError(f"the {NAME} class runs requests at once: pass --parallel 4 (2 at least)")


def run_concurrent(
    engine: Engine, modes: Sequence[str], repeats: int, max_tokens: int, log: Callable[[str], None]
) -> dict:
    """Each case in each mode, `repeats` times, the order of the modes alternating (chats of up to
    max_tokens tokens); per mode and case the medians of the latencies, the time to answer all,
    and its ratio to one after another."""
    check_engine(engine)
    cases = {"2 chats": 2, "4 chats": 4} if engine.sequences.count >= 4 else {"2 chats": 2}
    fim = not engine.target.fim.missing()
    samples: dict[str, dict[str, list[dict]]] = {mode: {} for mode in modes}
    for r in range(repeats):
        for mode in modes[::-1] if r % 2 else modes:
            engine.forget()  # every case reads its prompts anew
            rows = samples[mode]
            if fim:
                alone = one_after_another(engine, [_infill(mode)])[0]
                chat = Arrival(_chat(CHATS[0], mode, max(max_tokens, 4 * INFILL_AFTER)))
                infill = Arrival(_infill(mode), interactive=True, after=0, after_tokens=INFILL_AFTER)
                serve(engine, [chat, infill])
                rows.setdefault("infill during a chat", []).append(
                    {"alone_s": alone.latency, "together_s": infill.served.latency, "chat_s": chat.served.latency}
                )
            for case, n in cases.items():
                requests = [_chat(text, mode, max_tokens) for text in CHATS[:n]]
                apart = one_after_another(engine, requests)
                arrivals = [Arrival(request) for request in requests]
                together_s = serve(engine, arrivals)
                tokens = sum(a.served.tokens for a in arrivals)
                rows.setdefault(case, []).append(
                    {
                        "apart_s": sum(s.latency for s in apart),
                        "together_s": together_s,
                        "latency_s": float(np.median([a.served.latency for a in arrivals])),
                        "tokens_per_s": tokens / together_s,
                    }
                )
            log(
                f"{NAME} {r + 1}/{repeats} {mode}: "
                + ", ".join(f"{c} {v[-1]['together_s']:.1f}s" for c, v in rows.items())
            )
    return {
        "prompt": NAME,
        "repeats": repeats,
        "modes": {mode: {case: medians(runs) for case, runs in cases_of.items()} for mode, cases_of in samples.items()},
    }


def medians(runs: list[dict]) -> dict:
    """A case's runs as one row: the median of each figure, and together against apart (or alone)."""
    row = {key: float(np.median([run[key] for run in runs])) for key in runs[0]}
    apart = row.get("apart_s", row.get("alone_s"))
    row["together_vs_apart"] = row["together_s"] / apart
    return row


def print_rows(report: dict, column: str = "mode") -> None:
    """report["modes"]: rows (medians()) per case for each mode, or for each `column` (a server)."""
    print(
        f"{NAME}: requests at once (greedy, medians of {report['repeats']}); infill: its latency alone and during"
        f" a chat; chats: the time to answer all, together and one after another"
    )
    width = max(len(column), *map(len, report["modes"])) + 2
    print(f"{'case':<22}{column:<{width}}{'apart s':>9}{'together s':>12}{'ratio':>8}{'latency s':>11}{'tok/s':>8}")
    for mode, cases in report["modes"].items():
        for case, m in cases.items():
            apart = m.get("apart_s", m.get("alone_s"))
            latency = m.get("latency_s", m["together_s"])
            tokens_per_s = f"{m['tokens_per_s']:>8.2f}" if "tokens_per_s" in m else f"{'':>8}"
            print(
                f"{case:<22}{mode:<{width}}{apart:>9.2f}{m['together_s']:>12.2f}{m['together_vs_apart']:>7.2f}x"
                f"{latency:>11.2f}{tokens_per_s}"
            )
