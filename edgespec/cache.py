"""The cache folder (models, calibration.jsonl, prompts, memories, locks), the locks that keep
processes sharing it (a server, a command-line run, a pull) out of each other's way, and the
one way its files are written: whole or not at all."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def cache_dir() -> Path:
    if home := os.environ.get("EDGESPEC_HOME"):
        return Path(home)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "edgespec"


def replace_atomically(path: Path, write: Callable[[BinaryIO], None], mode: int = 0o644) -> None:
    """`path` replaced by what `write` writes, whole or not at all: into a temporary file beside
    it (`mode`: 0o600 for what only this user may read), flushed to the disk, then renamed over
    it; a process killed on the way leaves the old file, and a temporary named
    .NAME.PID.tmp that its owner's next save may remove."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def locked(name: str, waiting: str | None, *, wait: bool = True):
    """An exclusive lock across processes on `name` (a model file's pulls, the store's
    writes; released by the system if the process dies). Yields whether it was taken (always, if wait)."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "a+b") as f:
        taken = _try_lock(f)
        if not taken and wait:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
            _lock(f)
            taken = True
        yield taken


if os.name == "nt":
    import msvcrt

    def _try_lock(f) -> bool:
        try:
            msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _lock(f) -> None:
        while not _try_lock(f):
            time.sleep(0.5)

else:
    import fcntl

    def _try_lock(f) -> bool:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _lock(f) -> None:
        fcntl.flock(f, fcntl.LOCK_EX)
