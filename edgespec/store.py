"""What edgespec has measured about this machine (cost curves, flash attention, which
kernels work), kept in one JSON file in the model cache: `calibration.json`.

Entries are keyed by the machine, the llama.cpp build and the model file, so a new
CPU, a rebuilt llama-cpp-python or another quantization is measured afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from functools import cache
from pathlib import Path

import llama_cpp

from .cache import cache_dir, locked


def path():
    return cache_dir() / "calibration.json"


def read() -> dict:
    try:
        return json.loads(path().read_text())
    except (OSError, ValueError):
        return {}


def write(key: str, value) -> None:
    """Set one entry. Under a lock, so concurrent runs (a server and a CLI run) keep each
    other's entries; written atomically, so none ever reads a half-written file."""
    with locked(path().name, None):
        store = read()
        store[key] = value
        tmp = path().with_name(f".{path().name}.{os.getpid()}")
        tmp.write_text(json.dumps(store, indent=1))
        os.replace(tmp, path())


def machine() -> str:
    """This machine: host name, architecture and CPU model."""
    return f"{platform.node()}/{platform.machine()}/{_cpu_name()}"


@cache
def build() -> str:
    """This llama.cpp build: its version, the CPU features it was compiled for (AMX among
    them), and its library files (a rebuild with other CMAKE_ARGS is another build)."""
    features = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    try:
        libs = Path(llama_cpp.llama_cpp._lib._name).parent
        files = ",".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in sorted(libs.glob("lib*")))
    except (AttributeError, OSError):
        files = "?"
    return f"llama_cpp={llama_cpp.__version__}|{features}|{hashlib.sha256(files.encode()).hexdigest()[:16]}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
