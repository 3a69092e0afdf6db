"""Several runs at once: a step takes each to its next pass (the target's, or its draft model's),
then decodes their passes together (Engine.decode: one llama_decode per model where they fit a
batch, so every request's next rows read the weights once). A run's round stays its own (plan,
draft, verify, accept, cut back); the scheduler only gathers the rows.

Up to `parallel` tasks run at once, each in its own sequence of the models' contexts; the
ones beyond wait in the order they came. Interactive tasks (an editor's completion, which its
user waits for with the cursor still) take every decode while there are any; the others go on
after: each takes one more step, which reads what its last pass decoded (a view into llama.cpp's
buffer, which the next decode overwrites), and its next pass is held until it goes on. The
EngineThread runs one for the server; the concurrent bench drives one itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from .passes import Pass


@dataclass(eq=False)
class Task:
    """A generator work(*args) run a step at a time, yielding at each pass it needs decoded;
    what it returns, or raises, goes in the future."""

    future: Future
    work: Callable[..., Iterator]
    args: tuple
    interactive: bool = False
    steps: Iterator | None = field(default=None, repr=False)  # once started


class Scheduler:
    def __init__(self, decode: Callable[[list[Pass]], None], parallel: int = 1) -> None:
        """decode: decodes the passes of one step (Engine.decode); parallel: tasks run at once
        (the engine's sequences, see sequences.py)."""
        self.decode, self.parallel = decode, parallel
        self.waiting: deque[Task] = deque()  # beyond `parallel`: in the order they came
        self.running: list[Task] = []
        self.held: dict[Task, Pass] = {}  # the next pass of a task the interactive ones hold up

    def add(self, task: Task) -> None:
        self.waiting.append(task)

    def step(self) -> None:
        """Waiting tasks started while fewer than `parallel` run (interactive ones first); then one
        step of each running task, and the passes they handed out, decoded together: while there
        are interactive tasks, theirs alone (the others' are held, see the module docstring)."""
        self._admit()
        held_up = any(t.interactive for t in self.running)
        passes = []
        for task in list(self.running):
            goes_on = task.interactive or not held_up
            if task in self.held:
                if goes_on:
                    passes.append(self.held.pop(task))
                continue
            try:
                step = next(task.steps)
                if isinstance(step, Pass):
                    if goes_on:
                        passes.append(step)
                    else:
                        self.held[task] = step
            except StopIteration as end:
                self.running.remove(task)
                task.future.set_result(end.value)
            except BaseException as e:  # the caller's to report (as with an executor)
                self.running.remove(task)
                task.future.set_exception(e)
        if passes:
            try:
                self.decode(passes)
            except Exception as e:  # a bug (llama.cpp's refusals are each pass's error): its runs fail, the rest go on
                for one in passes:
                    one.error = e

    def cancel_waiting(self) -> None:
        while self.waiting:
            self.waiting.popleft().future.cancel()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.parallel:
            task = next((t for t in self.waiting if t.interactive), self.waiting[0])
            self.waiting.remove(task)
            if task.future.set_running_or_notify_cancel():
                task.steps = task.work(*task.args)
                self.running.append(task)
