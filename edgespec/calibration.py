"""What a forward pass costs on this machine: V(k), the seconds to evaluate k
tokens at once (all logits), measured per model file, thread count and machine.

Measured once at first load (a few seconds at most), cached in the model cache,
and rescaled from the timings of real rounds; saved again when the engine closes.
"""

from __future__ import annotations

import json
import os
import platform
from time import perf_counter

import llama_cpp
import numpy as np

from .model import Model
from .registry import cache_dir

TARGET_SIZES = (1, 2, 4, 6, 8, 16, 32)  # measured for the target; others interpolated
DRAFT_SIZES = (1, 2)  # a draft model decodes one token per step (two after a fully accepted round)
MAX_K = 65  # up to a 64-token n-gram draft plus the token before it
REFINE_WEIGHT = 0.1  # weight of one real round in the running estimate


class CostCurve:
    """Seconds for one forward pass over k tokens of one model, for k = 1..MAX_K:
    measured points, linear in between, the last slope beyond."""

    def __init__(self, seconds: dict[int, float]) -> None:
        ks = sorted(seconds)
        if len(ks) == 1:
            ks, seconds = ks + [ks[0] + 1], {**seconds, ks[0] + 1: 2 * seconds[ks[0]]}
        k = np.arange(MAX_K + 1)
        values = [seconds[x] for x in ks]
        slope = (values[-1] - values[-2]) / (ks[-1] - ks[-2])
        self.table = np.where(k <= ks[-1], np.interp(k, ks, values), values[-1] + slope * (k - ks[-1]))

    def __call__(self, k: int) -> float:
        return float(self.table[min(k, MAX_K)])

    def observe(self, k: int, seconds: float) -> None:
        """Fold in a real timing. The machine's speed drifts (other load, heat) for
        all k together, so the whole curve is rescaled and its measured shape kept;
        one outlier (a page fault) moves it little."""
        ratio = min(max(seconds / self.table[min(k, MAX_K)], 0.5), 2.0)
        self.table *= 1 + REFINE_WEIGHT * (ratio - 1)

    def as_dict(self) -> dict[int, float]:
        return {k: float(v) for k, v in enumerate(self.table) if k > 0}


def _key(model: Model, sizes) -> str:
    st = model.path.stat()
    machine = f"{platform.node()}/{platform.machine()}/{_cpu_name()}"
    setup = f"threads={model.n_threads}|gpu={model.n_gpu_layers}|llama_cpp={llama_cpp.__version__}"
    return f"{machine}|{model.path.name}:{st.st_size}|{setup}|k<={max(sizes)}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _store_path():
    return cache_dir() / "calibration.json"


def _read_store() -> dict:
    try:
        return json.loads(_store_path().read_text())
    except (OSError, ValueError):
        return {}


def measure(model: Model, sizes) -> CostCurve:
    """Time forward passes of k dummy tokens after a short prefix. Other load only
    ever adds time, so the fastest of a few tries is kept (more tries where they are cheap)."""
    sizes = [k for k in sizes if 16 + k <= model.n_ctx]
    model.truncate(0)
    prefix = [model.bos if model.bos >= 0 else 0] * 16
    model.eval(prefix)
    model.eval(prefix[:1], all_logits=True)  # warm-up: first decodes allocate
    seconds = {}
    for k in sizes:
        times = []
        for _ in range(3 if k == 1 else 2 if k <= 8 else 1):
            model.truncate(len(prefix))
            start = perf_counter()
            model.eval(prefix[:1] * k, all_logits=True)
            times.append(perf_counter() - start)
        seconds[k] = min(times)
    model.truncate(0)
    return CostCurve(seconds)


def load_or_measure(model: Model, sizes=TARGET_SIZES) -> CostCurve:
    """The cached curve for this model on this machine, or a fresh measurement."""
    cached = _read_store().get(_key(model, sizes))
    if cached:
        return CostCurve({int(k): float(v) for k, v in cached.items()})
    curve = measure(model, sizes)
    save(model, sizes, curve)
    return curve


def save(model: Model, sizes, curve: CostCurve) -> None:
    """Write atomically, so concurrent runs never leave a half-written file."""
    store = _read_store()
    store[_key(model, sizes)] = {str(k): v for k, v in curve.as_dict().items()}
    path = _store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(store, indent=1))
    os.replace(tmp, path)
