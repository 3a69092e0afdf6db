"""The child process of kernels.choose_repack: load one model with its weights repacked
or not and time the passes edgespec runs (a prompt chunk, a verify pass with all
logits, a single step), printing the seconds as JSON. A kernel that crashes takes
down only this process.

python -m edgespec._kernel_probe MODEL.gguf REPACK(0|1) THREADS GPU_LAYERS
"""

from __future__ import annotations

import json
import sys
from time import perf_counter

from .model import Model

PASSES = {"prompt": (64, None), "verify": (16, 16), "step": (1, 1)}  # name: (tokens, rows of logits)
TRIES = 3  # the fastest counts (other load only ever adds time)


def main(path: str, repack: bool, n_threads: int, n_gpu_layers: int) -> None:
    model = Model(path, n_ctx=256, n_threads=n_threads, n_gpu_layers=n_gpu_layers, repack=repack)
    model.eval([0] * 16)  # a cache to attend to; first decodes allocate
    base = len(model.tokens)
    times = {}
    for name, (k, rows) in PASSES.items():
        best = float("inf")
        for _ in range(TRIES):
            model.cache.checkpoint(k)
            start = perf_counter()
            model.eval([0] * k, rows=rows)
            best = min(best, perf_counter() - start)
            model.cache.truncate(base)
        times[name] = best
    print(json.dumps(times), flush=True)


if __name__ == "__main__":
    path, repack, n_threads, n_gpu_layers = sys.argv[1:]
    main(path, repack == "1", int(n_threads), int(n_gpu_layers))
