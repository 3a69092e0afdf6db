"""One thread for all of an engine's work.

llama.cpp's OpenMP builds give each thread that runs a model a thread team of its own;
once the teams outnumber the cores every pass slows down (by a quarter on 2 cores,
measured). So an engine is used from one thread only: the server and the chat app hand
their work to an EngineThread, which runs it in order. When nothing is queued it does
the engine's idle work a step at a time (Engine.idle_step: re-timing costs, reading ahead
for an editor's next keystroke), so that it never sits between an answer's last token and
its return, and a job that comes waits for one step at most.

A job that should stop early (a client gone, Esc in the chat) is told by its owner
through a flag it reads each round; close() drops the jobs not started, then runs its last one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from time import perf_counter

from .engine import Engine

REST_S = 0.1  # after a job, the engine waits this long before it works idle


class EngineThread:
    def __init__(self, name: str = "edgespec-engine") -> None:
        self.engine: Engine | None = None  # whose upkeep runs when idle (set once loaded)
        self._jobs: queue.Queue[tuple[Future, Callable, tuple] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable, *args) -> Future:
        """Run work(*args) on the engine thread after what is queued; its result or
        exception comes in the future."""
        future: Future = Future()
        self._jobs.put((future, work, args))
        return future

    def close(self, last: Callable | None = None) -> None:
        """Drop the jobs not started, let the running one finish, run last() (closing the
        engine, say) on the thread, end the thread."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        if last is not None:
            self.submit(last)
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            future, work, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(work(*args))
                except BaseException as e:  # the caller's to report (as with an executor)
                    future.set_exception(e)

    def _next(self) -> tuple[Future, Callable, tuple] | None:
        """The next job; until it comes, from REST_S after the last on, the engine's idle work, a
        step at a time (an editor sends its next request as the last answer comes: a step begun
        then would delay it)."""
        rested = perf_counter() + REST_S
        while True:
            try:
                return self._jobs.get(timeout=max(0.0, rested - perf_counter()))
            except queue.Empty:
                pass
            if self.engine is None or not self.engine.idle_step():
                return self._jobs.get()
