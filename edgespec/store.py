"""What edgespec has measured about this machine (cost curves, flash attention, which
kernels work), kept in one file in the model cache: `calibration.jsonl`, an entry a line.

Entries are keyed by the machine, the llama.cpp build and the model file, so a new
CPU, a rebuilt llama-cpp-python or another quantization is measured afresh. The file is
read entry by entry: a damaged line (a disk that lost part of a write, an edit by hand) is
set aside in `calibration.damaged` with one line on stderr, the other entries kept; it is
written whole or not at all, under a lock, so processes that write at once lose nothing.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from functools import cache
from pathlib import Path

import llama_cpp

from .cache import cache_dir, locked, replace_atomically

LOCK = "calibration"
DAMAGED = "calibration.damaged"


def path() -> Path:
    return cache_dir() / "calibration.jsonl"


def read() -> dict:
    """Every entry (a damaged line set aside, see the module's docstring)."""
    entries, damaged = _entries()
    if damaged:
        with locked(LOCK, None):
            entries = _settled()
    return entries


def write(key: str, value) -> None:
    """Set one entry, the others kept (those another process wrote meanwhile too)."""
    with locked(LOCK, None):
        entries = _settled()
        entries[key] = value
        _replace(entries)


def _entries() -> tuple[dict, list[str]]:
    """The file's entries, and its lines that are not one."""
    try:
        lines = path().read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return _before_jsonl(), []
    except OSError as e:
        print(f"edgespec: cannot read {path()} ({e.strerror}); measuring afresh", file=sys.stderr)
        return {}, []
    entries, damaged = {}, []
    for line in filter(str.strip, lines):
        try:
            entry = json.loads(line)
            entries[entry["key"]] = entry["value"]
        except (ValueError, TypeError, KeyError):
            damaged.append(line)
    return entries, damaged


def _settled() -> dict:
    """The entries, under the lock: damaged lines moved to DAMAGED, said once, the file rewritten
    without them."""
    entries, damaged = _entries()
    if damaged:
        with open(path().with_name(DAMAGED), "a", encoding="utf-8") as aside:
            aside.writelines(line + "\n" for line in damaged)
        print(
            f"edgespec: {len(damaged)} damaged entr{'y' if len(damaged) == 1 else 'ies'} of {path()} set aside in"
            f" {DAMAGED} (measured afresh); the other {len(entries)} kept",
            file=sys.stderr,
        )
        _replace(entries)
    return entries


def _replace(entries: dict) -> None:
    text = "".join(json.dumps({"key": k, "value": v}) + "\n" for k, v in entries.items())
    path().parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path(), lambda f: f.write(text.encode()))


def _before_jsonl() -> dict:
    """The entries of calibration.json, one JSON object (before this file's format), if any."""
    try:
        old = json.loads((cache_dir() / "calibration.json").read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


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
