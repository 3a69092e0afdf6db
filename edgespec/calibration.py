"""What a forward pass costs on this machine: V(k), the seconds to evaluate k tokens
at once (all logits), per model file, thread count, flash-attention setting and machine.

On a CPU V(k) is far from smooth: llama.cpp's batched kernels work in blocks, so 16,
32 or 64 tokens can cost less than 15, 31 or 63 (measured here: V(15) = 9.2 and
V(16) = 8.6 single-token steps). So points are measured where passes are cheap per
token (1-8, 16, 32, 64), the controller only plans passes of those sizes, and sizes
that real rounds happen to use become points too.

Measured once per machine (about 2 s for a 1.5B model on 2 cores), cached in the
model cache, moved by the timings of real rounds, and each point measured again once
it is older than RECHECK_S: a curve measured while the machine was busy must not
stick, even for pass sizes or a drafter the controller has stopped using because
they looked too slow. A pass over k tokens never costs more than k single steps
(BATCH_SLACK): a point timed above that was disturbed, is timed again and bounded.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import TypeVar

import llama_cpp
import numpy as np

from . import store
from .cost_curve import UNSPREAD, BatchSpread, CostCurve, RollbackCost, pass_bound
from .heads import Heads
from .kv_cache import Rollback
from .model import Model
from .passes import Pass

TARGET_SIZES = (1, 2, 4, 8, 16, 32, 64)  # batch sizes measured for a target
DRAFT_SIZES = (1, 2)  # a draft model decodes one token per step (two after a fully accepted round)
FLASH_RECHECK_S = 86400.0  # choose flash attention again (at load) when the choice is older than this
MEASURE_RETRIES = 2  # times a disturbed point is timed again
DISTURBED = 0.15  # single steps timed before and after a calibration this far apart: the load changed
PROBE_DEPTH = 16  # tokens in the cache while timing (a deeper cache costs seconds to fill)
FLASH_PROBE_SIZES = (1, 16)  # decode and a verify pass, timed with flash attention on and off
# On a CPU flash attention loses ground as the cache grows (measured on a 2-core EPYC, 1.5B
# model: decode 3-7% faster at depth 16 but 3% slower at 800; 32-token verify passes equal at
# depth 16, 10% slower at 400, 20% at 800), and a deep cache costs seconds per setting to fill.
# So at the probe's shallow depth it must be ahead on both kinds of pass by this margin.
FLASH_MARGIN = 0.02
ROLLBACK_TRIES = 3  # checkpoints and restores timed (the fastest counts)
SPREAD_SIZES = (2, 4, 8, 16)  # sequences a pass is spread over when measuring BatchSpread (as many as there are)
SPREAD_TRIES = 2  # passes timed each way (the fastest counts)
# Passes whose threads had less than this share of their cores' time ran beside other
# processes (a build, an indexer): their times say what the machine costs while crowded, not
# what it costs, so a re-check taken then is refused (see Usage.crowded). Judged over all of a
# measurement's passes: a single 7 ms step here falls to 0.66 on a quiet machine now and then
# (a thread woken late), which refused 3 in 30 quiet re-checks when each pass was judged alone.
CROWDED_SHARE = 0.7


T = TypeVar("T")


# --- the cache --------------------------------------------------------------------


def _setup(model: Model) -> str:
    st = model.path.stat()
    return (
        f"{store.machine()}|{model.path.name}:{st.st_size}|threads={model.n_threads}|gpu={model.n_gpu_layers}"
        f"|llama_cpp={llama_cpp.__version__}|repack={int(model.repack)}"
    )


def _key(model: Model, sizes) -> str:
    return f"{_setup(model)}|fa={int(model.flash_attn)}|k={','.join(map(str, sizes))}"


# --- measuring --------------------------------------------------------------------


@dataclass
class Usage:
    """The wall time of some timed passes on one model, and this process's CPU time over
    them (all its threads)."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.seconds + other.seconds, self.cpu_seconds + other.cpu_seconds)

    def crowded(self, model: Model) -> bool:
        """Whether these passes ran beside other processes: llama.cpp's threads keep their
        cores busy through a pass, unless the cores are taken from them. (On a GPU the CPU
        waits: never.)"""
        if model.n_gpu_layers > 0:
            return False
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        cores = min(model.n_threads, available)
        return self.cpu_seconds < CROWDED_SHARE * cores * self.seconds


class Timer:
    """Times a model's passes for the calibration (measure, recheck and choose_flash_attn
    take one; tests give their own): timer(model, k, tries) is the fastest of `tries` passes
    over k tokens (other load only ever adds time) on top of what the cache holds, which is
    left as it was (a conversation's cache survives a re-check); an empty cache first gets a
    short dummy prefix. `usage` then holds what all those passes took, for the caller to
    judge (with its other passes') whether the CPU was crowded."""

    def __init__(self) -> None:
        # points timed while choosing flash attention, reused by measure() (keyed by _key(model, ()))
        self.probed: dict[str, dict[int, float]] = {}
        self.usage = Usage()

    def __call__(self, model: Model, k: int, tries: int) -> float:
        if not model.tokens:
            model.eval([0] * PROBE_DEPTH)
            model.cache.checkpoint(1)
            model.eval([0], rows=1)  # warm-up: first decodes allocate
            model.cache.truncate(PROBE_DEPTH)
        base = len(model.tokens)
        best, self.usage = float("inf"), Usage()
        if base + k > model.n_ctx:
            return float("nan")
        for _ in range(tries):
            model.cache.checkpoint(k)  # (a recurrent state: timed apart, see measure_rollback)
            start, cpu = perf_counter(), time.process_time()
            model.eval(model.tokens[-1:] * k, rows=k)
            seconds = perf_counter() - start
            self.usage += Usage(seconds, time.process_time() - cpu)
            best = min(best, seconds)
            model.cache.truncate(base)
        return best

    def spread(self, model: Model, sequences: int, tries: int) -> float:
        """The fastest of `tries` passes of one token in each of the first `sequences` sequences,
        decoded together, on top of what each holds (an empty one gets a dummy prefix for the
        time being); every sequence is left as it was."""
        current, held = model.seq, []
        for seq in range(sequences):
            model.use(seq)
            held.append(len(model.tokens))
            if not model.tokens:
                model.eval([0] * PROBE_DEPTH)
        depths = [len(model.sequence_tokens(seq)) for seq in range(sequences)]
        best, self.usage = float("inf"), Usage()
        for _ in range(tries):
            passes = [Pass(seq, model.sequence_tokens(seq)[-1:]) for seq in range(sequences)]
            start, cpu = perf_counter(), time.process_time()
            model.decode(passes)
            seconds = perf_counter() - start
            self.usage += Usage(seconds, time.process_time() - cpu)
            if any(p.error is not None for p in passes):  # no room left in a sequence
                best = float("nan")
            best = min(best, seconds)  # (NaN stays NaN)
            for seq, depth in enumerate(depths):
                model.use(seq)
                model.cache.truncate(depth)
        for seq, tokens in enumerate(held):
            model.use(seq)
            model.cache.truncate(tokens)
        model.use(current)
        return best


TIMER = Timer()  # this process's


def measure(model: Model, sizes, timer: Timer = TIMER) -> CostCurve:
    """Time each size: the single step a few times, the others once, and again (keeping
    the fastest) where a pass cost more than its tokens one at a time would. The single
    step is timed again at the end: if the machine's load changed meanwhile (the two
    differ by DISTURBED, or a pass had to be timed again) or its passes ran on a crowded CPU,
    every point is due for a re-check at once, so a curve taken on a busy machine is
    renewed over the next answers."""
    sizes = [k for k in sizes if PROBE_DEPTH + k < model.n_ctx]
    known = timer.probed.get(_key(model, ()), {})
    points, disturbed, usage = {}, False, Usage()
    for k in sizes:
        if k not in known:
            points[k] = timer(model, k, 3 if k == 1 else 1)
            usage += timer.usage
        else:
            points[k] = known[k]
    for k in sizes:
        for _ in range(MEASURE_RETRIES):
            if k == 1 or points[k] <= pass_bound(k, points[1]):
                break
            disturbed = True
            points[k] = min(points[k], timer(model, k, 1))
    if 1 in points:
        again = timer(model, 1, 3)
        usage += timer.usage
        disturbed |= abs(again - points[1]) > DISTURBED * min(again, points[1])
        points[1] = min(points[1], again)
    curve = CostCurve(points)
    if disturbed or usage.crowded(model):
        curve.mark_stale()
    return curve


def _cached(key: str, from_json: Callable[[dict], T]) -> T | None:
    """What the store holds under `key`, or None (nothing, or written by an older version: measure again)."""
    cached = store.read().get(key)
    if cached:
        try:
            return from_json(cached)
        except (KeyError, TypeError, ValueError):
            pass
    return None


def _remembered(key: str, from_json: Callable[[dict], T], measure: Callable[[], T]) -> T:
    """What the store holds under `key`, else measured now and kept there."""
    if (cached := _cached(key, from_json)) is not None:
        return cached
    measured = measure()
    store.write(key, measured.to_json())
    return measured


def load_or_measure(model: Model, sizes=TARGET_SIZES, timer: Timer = TIMER) -> CostCurve:
    """The cached curve for this model on this machine, or a fresh measurement."""
    return _remembered(_key(model, sizes), CostCurve.from_json, lambda: measure(model, sizes, timer))


def load_or_measure_rollback(model: Model) -> RollbackCost | None:
    """What cutting `model`'s state back costs here (cached per machine and model file), or
    None where the cache is simply cut (attention alone)."""
    if model.cache.rollback is Rollback.TRUNCATE:
        return None
    key = f"{_setup(model)}|fa={int(model.flash_attn)}|rollback={model.cache.rollback.value}:{model.n_snapshots}"
    return _remembered(key, RollbackCost.from_json, lambda: measure_rollback(model))


def measure_rollback(model: Model) -> RollbackCost:
    """Time a checkpoint of the recurrent state and its restore after a one-token pass, on
    top of what the cache holds (left as it was). Nothing here assumes that a partial
    removal works: the restore is the way back that model.cache.truncate takes without snapshots."""
    if len(model.tokens) < PROBE_DEPTH:
        model.cache.truncate(0)
        model.eval([0] * PROBE_DEPTH)
    base = len(model.tokens)
    saves, restores = [], []
    for _ in range(ROLLBACK_TRIES):
        start = perf_counter()
        model.cache.checkpoint()
        saves.append(perf_counter() - start)
        model.eval(model.tokens[-1:])
        start = perf_counter()
        model.cache.truncate(base)
        restores.append(perf_counter() - start)
    return RollbackCost(min(saves), min(restores), model.n_snapshots)


def load_or_measure_spread(model: Model, timer: Timer = TIMER) -> BatchSpread:
    """What spreading a pass over several of `model`'s sequences costs here (cached per machine,
    model file and sequence count; not cached when measured on a crowded CPU); UNSPREAD where
    there is one sequence or the model is recurrent (model.decode decodes its passes alone)."""
    if model.n_seq == 1 or model.recurrent:
        return UNSPREAD
    key = f"{_setup(model)}|fa={int(model.flash_attn)}|spread={model.n_seq}"
    if (cached := _cached(key, BatchSpread.from_json)) is not None:
        return cached
    spread, usage = measure_spread(model, timer)
    if not usage.crowded(model):
        store.write(key, spread.to_json())
    return spread


def measure_spread(model: Model, timer: Timer = TIMER) -> tuple[BatchSpread, Usage]:
    """W(n) / V(n) for n of SPREAD_SIZES up to the model's sequences: a pass of one token in each
    of n sequences against n tokens in one, the two timed in turn under the same load (the
    fastest of SPREAD_TRIES each); and what all those passes took. A pair that found no room
    (NaN) is left out."""
    factors, usage, current = {}, Usage(), model.seq
    model.use(0)
    for n in sorted({min(size, model.n_seq) for size in SPREAD_SIZES}):
        spread, one = [], []
        for _ in range(SPREAD_TRIES):
            spread.append(timer.spread(model, n, 1))
            usage += timer.usage
            one.append(timer(model, n, 1))
            usage += timer.usage
        if not any(math.isnan(seconds) for seconds in spread + one):
            factors[n] = min(spread) / min(one)
    model.use(current)
    return BatchSpread(factors), usage


def load_or_measure_heads(heads: Heads) -> CostCurve:
    """What a step of the target's MTP layers costs here (cached per machine and model file)."""
    return _remembered(f"{_setup(heads.target)}|heads", CostCurve.from_json, lambda: measure_heads(heads))


def measure_heads(heads: Heads) -> CostCurve:
    """The MTP layers' step (one token read after a few in the cache, with the state before it;
    the fastest of 3), each of DRAFT_SIZES; the layers' cache left as it was."""
    seq = heads.target.seq
    base = heads.positions(seq)
    state = np.zeros((max(DRAFT_SIZES), heads.width), np.float32)
    if base == 0:
        heads.read(seq, [0] * PROBE_DEPTH, np.zeros((PROBE_DEPTH, heads.width), np.float32))
    depth, points = heads.positions(seq), {}
    for k in DRAFT_SIZES:
        times = []
        for _ in range(3):
            start = perf_counter()
            heads.read(seq, [0] * k, state[:k])
            times.append(perf_counter() - start)
            heads.cut(seq, depth)
        points[k] = min(times)
    heads.cut(seq, base)
    return CostCurve(points)


def save(model: Model, sizes, curve: CostCurve) -> None:
    store.write(_key(model, sizes), curve.to_json())


def recheck(curves: list[tuple[Model, CostCurve]], *, every: bool = False, timer: Timer = TIMER) -> bool:
    """Measure again what is due (CostCurve.due: a point a curve), alternating between the
    models so that both see the same load; every: until nothing is due. False where a pass
    found no room in the context (its point stays due, for a re-check on an emptier one) or
    the CPU was crowded."""
    while plans := [(model, curve, k) for model, curve in curves if (k := curve.due()) is not None]:
        if not _recheck(plans, timer):
            return False
        if not every:
            break
    return True


def _recheck(plans: list[tuple[Model, CostCurve, int]], timer: Timer) -> bool:
    """Each plan's point timed again; False where one had no room left in the context, or the
    CPU was crowded (then nothing is folded in: a busy machine's figures would stay, and
    speculation would be ruled out where it pays once the machine is quiet again)."""
    steps: list[list[float]] = [[] for _ in plans]
    usages = [Usage() for _ in plans]
    passes = []
    for i, (model, _, k) in enumerate(plans):
        passes.append(timer(model, k, 1))
        usages[i] += timer.usage
    for _ in range(2):  # the cheap single step twice (the faster counts)
        for i, (model, _, _) in enumerate(plans):
            steps[i].append(timer(model, 1, 1))
            usages[i] += timer.usage
    if any(usage.crowded(model) for (model, _, _), usage in zip(plans, usages, strict=True)):
        return False
    fastest = [min(times) for times in steps]
    for (_, curve, k), step, seconds in zip(plans, fastest, passes, strict=True):
        if not math.isnan(step):  # NaN: no room left in the context
            curve.recheck(step, k, seconds)
    return not any(math.isnan(seconds) for seconds in passes + fastest)


def choose_flash_attn(model: Model, timer: Timer = TIMER) -> bool:
    """Flash attention on or off, whichever decodes and verifies faster on this machine
    (measured once, cached; see FLASH_MARGIN): it wins on some CPUs and loses on others.
    Leaves the model's context set to the choice. Chosen again after FLASH_RECHECK_S, in
    case it was made on a busy machine. On a GPU it is on."""
    if model.n_gpu_layers > 0:
        model.set_flash_attn(True)
        return True
    key = f"{_setup(model)}|flash_attn"
    choice = store.read().get(key)
    if not isinstance(choice, dict) or time.time() - choice.get("checked_at", 0.0) > FLASH_RECHECK_S:
        points = {}
        for flash_attn in (True, False):
            model.set_flash_attn(flash_attn)
            points[flash_attn] = {k: timer(model, k, 3 if k == 1 else 1) for k in FLASH_PROBE_SIZES}
            timer.probed[_key(model, ())] = points[flash_attn]
        on = all(points[True][k] < (1 - FLASH_MARGIN) * points[False][k] for k in FLASH_PROBE_SIZES)
        choice = {"on": on, "checked_at": time.time()}
        store.write(key, choice)
    model.set_flash_attn(bool(choice["on"]))
    return bool(choice["on"])
