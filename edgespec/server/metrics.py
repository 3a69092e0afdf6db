"""`serve --metrics`: what the server has done since it started, in Prometheus' text format
(GET /metrics), under llama-server's names where it has them (llamacpp:...) and ours where it
has none (edgespec:...): rounds, draft tokens proposed and kept by source, the speedup measured
over the target alone."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from ..stats import Stats


@dataclass(frozen=True)
class ServerLoad:
    """What the server holds now, beside the counts: requests running and waiting, the KV cache."""

    processing: int
    deferred: int
    kv_tokens: int
    n_ctx: int
    idle_faults: int = 0  # idle steps that failed (EngineThread.idle_faults)
    resident_bytes: int | None = None  # the process's memory in RAM (resident_bytes())
    prompt_cache_bytes: dict[str, int] = field(default_factory=dict)  # saved prompt states "ram" and "disk"


def resident_bytes() -> int | None:
    """This process's resident memory, where the system tells it (/proc on Linux); else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


FAULTS_HELP = "The server's own failures: requests (a 500 or an error event), idle work (retried)"


class Metrics:
    """Counts of the answers finished so far (added on the engine's thread, read on the server's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total: Stats | None = None  # the answers' statistics summed (Stats.combine)
        self._answers = 0
        self._last_speedup = 0.0
        self._longest = 0
        self._faults = 0  # requests that failed on the server's side

    def fault(self) -> None:
        """A request answered 500, or ended by an error event, for a failure of the server's own."""
        with self._lock:
            self._faults += 1

    def add(self, stats: Stats) -> None:
        """One answer's final statistics."""
        with self._lock:
            self._total = stats if self._total is None else Stats.combine([self._total, stats])
            self._last_speedup = stats.measured_speedup or self._last_speedup
            self._longest = max(self._longest, stats.n_prompt + stats.n_tokens)
            self._answers += 1

    def text(self, load: ServerLoad) -> str:
        """The exposition: each metric's HELP, TYPE and samples."""
        with self._lock:
            t = self._total or Stats(mode="speculative", gamma="auto")
            answers, speedup, longest = self._answers, self._last_speedup, self._longest
            drafted, accepted = dict(t.drafted_by_source), dict(t.accepted_by_source)
            rounds = dict(t.rounds_by_source)
            faults = {"request": self._faults, "idle": load.idle_faults}
        lines: list[str] = []

        def family(name: str, kind: str, about: str, value: float | dict[str, float], label: str = "source") -> None:
            """One metric: a value, or values by a label (the draft source)."""
            lines.extend((f"# HELP {name} {about}", f"# TYPE {name} {kind}"))
            by_label = value.items() if isinstance(value, dict) else [(None, value)]
            for name_of, v in by_label:
                labels = "" if name_of is None else f'{{{label}="{name_of}"}}'
                lines.append(f"{name}{labels} {float(v)!r}")

        family(
            "llamacpp:prompt_tokens_total",
            "counter",
            "Prompt tokens read (not from the cache)",
            t.n_prompt - t.n_prompt_cached,
        )
        family(
            "llamacpp:prompt_tokens_cached_total", "counter", "Prompt tokens reused from the cache", t.n_prompt_cached
        )
        family("llamacpp:prompt_seconds_total", "counter", "Time spent reading prompts", t.prefill_s)
        family("llamacpp:tokens_predicted_total", "counter", "Tokens generated", t.n_tokens)
        family("llamacpp:tokens_predicted_seconds_total", "counter", "Time spent generating", t.decode_s)
        family("llamacpp:n_tokens_max", "counter", "Longest sequence seen (prompt and answer)", longest)
        family("llamacpp:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified", t.drafted)
        family("llamacpp:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens kept", t.accepted)
        family("llamacpp:requests_processing", "gauge", "Requests being answered", load.processing)
        family("llamacpp:requests_deferred", "gauge", "Requests waiting for their turn", load.deferred)
        family("llamacpp:kv_cache_tokens", "gauge", "Tokens in the target's KV cache", load.kv_tokens)
        family(
            "llamacpp:kv_cache_usage_ratio",
            "gauge",
            "Share of the target's context in use",
            load.kv_tokens / load.n_ctx if load.n_ctx else 0.0,
        )
        family("edgespec:answers_total", "counter", "Answers finished", answers)
        family("edgespec:rounds_total", "counter", "Rounds (target passes after the prompt) by draft source", rounds)
        family("edgespec:draft_tokens_total", "counter", "Draft tokens verified, by source", drafted)
        family(
            "edgespec:accepted_tokens_total",
            "counter",
            "Draft tokens kept, by source",
            {s: accepted.get(s, 0) for s in drafted},
        )
        family("edgespec:faults_total", "counter", FAULTS_HELP, faults, label="where")
        if load.resident_bytes is not None:  # (Prometheus' client names it so)
            family("process_resident_memory_bytes", "gauge", "Resident memory size in bytes", load.resident_bytes)
        family(
            "edgespec:prompt_cache_bytes",
            "gauge",
            "Saved prompt states, in RAM (used lately) and on disk",
            load.prompt_cache_bytes,
            label="where",
        )
        family("edgespec:measured_speedup", "gauge", "The last measured answer's speed over the target alone", speedup)
        return "\n".join(lines) + "\n"
