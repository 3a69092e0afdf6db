"""Which of llama.cpp's CPU kernels run here: weights repacked into llama.cpp's extra
buffer types (its default: interleaved blocks for the AVX2/AVX-512/NEON kernels, AMX
tiles on Intel CPUs that have AMX) or loaded as they are (llama.cpp's --no-repack).

Decided by running them, not from CPU names: llama.cpp 0.3.36 built for an AMX CPU
(pip builds with -march=native) crashes in its AMX matmul on any batch of 2 or more
tokens (llama.cpp #20824), a segfault no Python code survives. So the first time a
build meets a machine and a model file, a child process loads the model each way and
runs a prompt pass, a verify pass and single steps (_kernel_probe.py). A setting
whose child dies is never used; where both work, the one that serves a typical request
(REQUEST) faster is kept: repacking, llama.cpp's default, unless loading as-is is faster
by MARGIN. The verdict is kept in the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import store
from .cache import locked
from .errors import EdgespecError

PROBE_TIMEOUT_S = 300.0  # a child this slow hangs (a cold 1.5B model loads in seconds)
# A typical assistant's request, in the probe's passes: a 1024-token prompt, a 256-token answer.
# Both matter: on a 2-core EPYC (Qwen2.5 1.5B Q4_K_M) weights as-is prefill 27% faster and
# decode 29% slower than repacked ones; on a Xeon with AMX as-is wins both.
REQUEST = {"prompt": 1024 // 64, "step": 256}
# As-is must make that request this much faster than repacking (llama.cpp's default). A
# narrow margin tips on timing noise: the EPYC above came out 0.5% and 3.5% either way.
MARGIN = 0.10
RECHECK_S = 7 * 86400.0  # a choice between two working settings is made again weekly (it may have met a busy machine)


@dataclass(frozen=True)
class Probe:
    """How one setting ran in its child process."""

    repack: bool
    times: dict[str, float] = field(default_factory=dict)  # seconds per pass of the probe; empty if it failed
    failure: str = ""  # why it failed, e.g. "crashed (SIGSEGV)"
    crashed: bool = False  # died on a signal or hung (not a load error the parent reports itself)


def plain_llama(path: Path, repack: bool, **options):
    """llama-cpp-python's own Llama on `path` (bench's yardstick, the tests' reference), with
    the kernels our Model runs: where repacked ones crash, Llama()'s default would take the
    process down. Llama() has no repack setting and takes its model parameters from
    llama_model_default_params(), so that gives ours while it is built. Llama() also sets
    llama.cpp's log level for the whole process: ours (quiet unless EDGESPEC_VERBOSE) is kept."""
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama
    from llama_cpp._logger import logger

    defaults, level = lib.llama_model_default_params, logger.level

    def ours():
        params = defaults()
        params.use_extra_bufts = repack
        return params

    lib.llama_model_default_params = ours
    try:
        return Llama(model_path=str(path), **options)
    finally:
        lib.llama_model_default_params = defaults
        logger.setLevel(level)


def choose_repack(path: Path, n_threads: int, n_gpu_layers: int) -> bool:
    """Whether to load `path` with repacked weights: the cached verdict for this machine,
    build and model file, else probed now (a few seconds, once)."""
    key = verdict_key(path, n_threads, n_gpu_layers)
    if _current(verdict := store.read().get(key)):
        return verdict["repack"]
    with locked(f"{path.name}.kernels", None):  # one probe at a time: two would slow each other's timings
        if not _current(verdict := store.read().get(key)):
            verdict = _decide(path, n_threads, n_gpu_layers)
            if verdict is None:  # neither setting loaded at all: the caller's own load says why
                return True
            store.write(key, verdict)
    return verdict["repack"]


def verdict_key(path: Path, n_threads: int, n_gpu_layers: int) -> str:
    """Where choose_repack keeps its verdict on `path`: per machine, build, file (its name and
    size), threads and offloaded layers."""
    model = f"{path.name}:{path.stat().st_size}|threads={n_threads}|gpu={n_gpu_layers}"
    return f"{store.machine()}|{store.build()}|{model}|repack"


def _current(verdict) -> bool:
    if not isinstance(verdict, dict) or not isinstance(verdict.get("repack"), bool):
        return False
    return verdict.get("crashed") is not None or time.time() - verdict.get("checked_at", 0.0) < RECHECK_S


def _decide(path: Path, n_threads: int, n_gpu_layers: int) -> dict | None:
    on, off = (_probe(path, repack, n_threads, n_gpu_layers) for repack in (True, False))
    if on.times and off.times:
        cost = {p.repack: sum(n * p.times[name] for name, n in REQUEST.items()) for p in (on, off)}
        times = {"on": on.times, "off": off.times}
        return {"repack": cost[False] >= (1 - MARGIN) * cost[True], "times": times, "checked_at": time.time()}
    if not on.times and not off.times:
        if on.crashed or off.crashed:
            raise EdgespecError(
                f"llama.cpp's CPU kernels crash running {path.name} on this machine ({on.failure} with repacked"
                f" weights, {off.failure} without); rebuild llama-cpp-python for this CPU (README: CMAKE_ARGS)"
                " or use another model file"
            )
        return None
    works, fails = (on, off) if on.times else (off, on)
    print(
        f"edgespec: llama.cpp's {_kernels(fails.repack)} kernels {fails.failure} with {path.name} on this CPU;"
        f" using its {_kernels(works.repack)} kernels (remembered for this machine and build)",
        file=sys.stderr,
        flush=True,
    )
    return {"repack": works.repack, "crashed": fails.failure, "checked_at": time.time()}


def _kernels(repack: bool) -> str:
    if not repack:
        return "plain (weights not repacked)"
    return "repacked (AMX)" if "AMX_INT8 = 1" in store.build() else "repacked"


def probe_command(path: Path, repack: bool, n_threads: int, n_gpu_layers: int) -> list[str]:
    """The probe child's command line (a seam: tests put one that crashes in its place)."""
    settings = (path, int(repack), n_threads, n_gpu_layers)
    return [sys.executable, "-m", "edgespec._kernel_probe", *map(str, settings)]


def _probe(path: Path, repack: bool, n_threads: int, n_gpu_layers: int) -> Probe:
    package_root = str(Path(__file__).resolve().parent.parent)  # the child imports this same edgespec
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    argv = probe_command(path, repack, n_threads, n_gpu_layers)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return Probe(repack, failure=f"hung (no answer in {PROBE_TIMEOUT_S:.0f} s)", crashed=True)
    if done.returncode < 0:
        return Probe(repack, failure=f"crashed ({signal.Signals(-done.returncode).name})", crashed=True)
    try:
        return Probe(repack, times=json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Probe(repack, failure=f"failed (exit {done.returncode}: {last})")
