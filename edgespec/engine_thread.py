"""One thread for all of an engine's work.

llama.cpp's OpenMP builds give each thread that runs a model a thread team of its own;
once the teams outnumber the cores every pass slows down (by a quarter on 2 cores,
measured). So an engine is used from one thread only: the server and the chat app hand
their work to an EngineThread.

It runs two kinds of work. A job (submit) runs whole, between two steps of the rest:
loading, counting tokens, the chat app's answer. A task (start) is a generator that yields
at each pass it needs decoded (a prefill chunk, a draft step, a round's verify pass): a Scheduler
(scheduler.py) runs up to `parallel` of them at once, decoding their passes together, so
that a request's wait never depends on the length of another's answer.

When nothing is queued or running it does the engine's idle work a step at a time
(Engine.idle_step: re-timing costs, reading ahead for an editor's next keystroke), so that
it never sits between an answer's last token and its return, and work that comes waits for
one step at most.

A task that should stop early (a client gone, Esc in the chat) is told by its owner through
a flag it reads each round; close() drops the tasks and jobs not started, lets the running
tasks end, then runs its last job.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from time import perf_counter

from .engine import Engine
from .scheduler import Scheduler, Task

log = logging.getLogger("edgespec")

REST_S = 0.1  # after a job, the engine waits this long before it works idle
IDLE_BACKOFF_S = 60.0  # idle work that keeps failing is tried again at most this far apart


@dataclass(eq=False)
class Job:
    """Work run whole: work(*args), its result or exception in the future."""

    future: Future
    work: Callable
    args: tuple


@dataclass(frozen=True)
class Closing:
    """The thread's last item: after the running tasks end, last() runs, and the thread ends."""

    last: Callable | None


class EngineThread:
    def __init__(self, name: str = "edgespec-engine", parallel: int = 1) -> None:
        """parallel: tasks run at once (the engine's sequences, see sequences.py)."""
        self.engine: Engine | None = None  # whose upkeep runs when idle, whose passes it decodes (set once loaded)
        self.idle_faults = 0  # idle steps that failed (each tried again, backing off)
        self._idle_causes: set[str] = set()  # said once each
        self._idle_failing = 0  # idle steps that failed in a row (see _rest)
        self._queue: queue.Queue[Job | Task | Closing] = queue.Queue()
        self._tasks = Scheduler(lambda passes: self.engine.decode(passes), parallel)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable, *args) -> Future:
        """Run work(*args) on the engine thread, whole, between two steps of the tasks running;
        its result or exception comes in the future."""
        future: Future = Future()
        self._queue.put(Job(future, work, args))
        return future

    def start(self, work: Callable[..., Iterator], *args, interactive: bool = False) -> Future:
        """Run the generator work(*args) a step at a time beside the other tasks (see the module
        docstring); what it returns, or raises, comes in the future."""
        future: Future = Future()
        self._queue.put(Task(future, work, args, interactive))
        return future

    @property
    def load(self) -> tuple[int, int]:
        """Tasks running, and waiting to run (read from any thread: an estimate)."""
        return len(self._tasks.running), self._queue.qsize() + len(self._tasks.waiting)

    def close(self, last: Callable | None = None) -> None:
        """Drop the tasks and jobs not started, let the running tasks end, run last() (closing the
        engine, say) on the thread, end the thread."""
        while True:
            try:
                self._queue.get_nowait().future.cancel()
            except queue.Empty:
                break
        self._queue.put(Closing(last))
        self._thread.join()

    def _run(self) -> None:
        while True:
            closing = self._take(wait=not (self._tasks.running or self._tasks.waiting))
            if closing is not None:
                break
            self._tasks.step()
        self._tasks.cancel_waiting()
        while self._tasks.running:
            self._tasks.step()
        if closing.last is not None:
            _call(Job(Future(), closing.last, ()))

    def _take(self, wait: bool) -> Closing | None:
        """What was queued: jobs run now, tasks join the waiting; the Closing if it came. wait:
        until something comes, working idle meanwhile."""
        while True:
            try:
                item = self._next() if wait else self._queue.get_nowait()
            except queue.Empty:
                return None
            wait = False
            if isinstance(item, Closing):
                return item
            if isinstance(item, Task):
                self._tasks.add(item)
            else:
                _call(item)

    def _next(self) -> Job | Closing:
        """The next item; until it comes, from REST_S after the last on, the engine's idle work, a
        step at a time (an editor sends its next request as the last answer comes: a step begun
        then would delay it)."""
        rested = perf_counter() + self._rest(REST_S)
        while True:
            try:
                return self._queue.get(timeout=max(0.0, rested - perf_counter()))
            except queue.Empty:
                pass
            if self._idle_step() is not False:
                rested = perf_counter() + self._rest(0.0)
            elif (due := self.engine.idle_due() if self.engine is not None else None) is not None:
                rested = perf_counter() + due  # work that waits for time to pass (Engine.idle_due)
            else:
                return self._queue.get()

    def _rest(self, seconds: float) -> float:
        """How long to wait before the next idle step: `seconds`, or after failures in a row a
        wait that doubles with each (IDLE_BACKOFF_S at most)."""
        return min(REST_S * 2**self._idle_failing, IDLE_BACKOFF_S) if self._idle_failing else seconds

    def _idle_step(self) -> bool | None:
        """One step of the engine's idle work: True where there was one, False where there is none,
        None where it failed (a bug, or llama.cpp failing): counted, said once per cause with its
        traceback, and tried again later (_rest)."""
        try:
            worked = self.engine is not None and self.engine.idle_step()
        except Exception as e:  # the thread goes on serving whatever idle work raises
            self.idle_faults += 1
            self._idle_failing += 1
            cause = f"{type(e).__name__}: {e}".splitlines()[0]
            if cause not in self._idle_causes:
                self._idle_causes.add(cause)
                log.error("idle work failed (tried again, backing off): %s", cause, exc_info=e)
            return None
        self._idle_failing = 0
        return worked


def _call(job: Job) -> None:
    if job.future.set_running_or_notify_cancel():
        try:
            job.future.set_result(job.work(*job.args))
        except BaseException as e:  # the caller's to report (as with an executor)
            job.future.set_exception(e)
