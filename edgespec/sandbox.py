"""Untrusted input, worked on where it can do no harm.

A model's chat template is Jinja code shipped inside a downloaded file, and a client's
JSON schema is turned into a grammar by llama-cpp-python's converter (Python that
builds strings as large as the schema asks). Either can build a 10 GB string, loop for
hours or recurse without end. So both run in a small worker process
(_sandbox_worker.py) whose memory is capped and which is killed after its time limit;
whatever the input does, the caller gets one exception and the next request starts a
fresh worker. A request costs about a millisecond more than in-process (a JSON round
trip over a pipe).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

from .errors import EdgespecError

# address space of the worker: Python and Jinja take about 100 MB of it, a real template renders in a few;
# the program waits for the worker, so its peak counts in the program's own (wait4)
MEMORY = 512 << 20
WORKER = Path(__file__).with_name("_sandbox_worker.py")


class SandboxTimeout(Exception):
    """The request ran past its time limit (the worker was killed)."""


class SandboxCrashed(Exception):
    """The worker died on the request (out of memory, or crashed)."""


class Sandbox:
    """The worker process: started on first use, and again after it was killed."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()

    def ask(self, request: dict, seconds: float) -> dict:
        """The worker's answer to `request` (see _sandbox_worker.py for the kinds)."""
        with self._lock:
            process = self._start()
            try:
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                line = self._answers.get(timeout=seconds)
            except queue.Empty:
                self._kill()
                raise SandboxTimeout from None
            except OSError:  # the worker died while reading the request
                line = None
            if line is None:
                self._kill()
                raise SandboxCrashed
            return json.loads(line)

    def answer(self, request: dict, seconds: float, *, what: str, fix: str, error=EdgespecError) -> dict:
        """The worker's answer, or `error` in one sentence: `what` (the input, as the
        user knows it) ran too long, crashed the worker or failed; `fix` says what to do."""
        try:
            answer = self.ask(request, seconds)
        except SandboxTimeout:
            raise error(f"{what} ran for more than {seconds:g} s; {fix}") from None
        except SandboxCrashed:
            raise error(f"{what} crashed the sandbox worker; {fix}") from None
        if "error" in answer:
            raise error(f"{what} failed ({answer['error']}); {fix}")
        return answer

    def _start(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, str(WORKER), str(MEMORY)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                encoding="utf-8",
                bufsize=1,
            )
            self._answers = queue.Queue()
            threading.Thread(target=self._read, args=(self._process, self._answers), daemon=True).start()
        return self._process

    @staticmethod
    def _read(process: subprocess.Popen, answers: queue.Queue) -> None:
        for line in process.stdout:
            answers.put(line)
        answers.put(None)

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None


sandbox = Sandbox()
