"""Chat templates from GGUF files: untrusted code, rendered where it can do no harm.

A chat template is Jinja code shipped inside a downloaded model. Jinja's sandbox
(ImmutableSandboxedEnvironment) stops attribute escapes, but not resource bombs: a
template can build a 10 GB string, loop for hours or recurse without end. So templates
render in a small worker process (_template_worker.py) whose memory is capped and which
is killed after RENDER_SECONDS; whatever a template does, the caller gets one
EdgespecError and the next render starts a fresh worker. A normal render costs about a
millisecond more than in-process (a JSON round trip over a pipe).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

from .errors import EdgespecError

Message = dict[str, str]

RENDER_SECONDS = 2.0  # a template that takes longer is killed
RENDER_MEMORY = 1 << 30  # address space of the worker (Python and Jinja take about 100 MB of it)
WORKER = Path(__file__).with_name("_template_worker.py")
FIX = "send the prompt as plain text with --raw (or fix the model's template)"


class _Worker:
    """The rendering process: started on first use, and again after it was killed."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()

    def ask(self, request: dict) -> dict:
        with self._lock:
            process = self._start()
            try:
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                line = self._answers.get(timeout=RENDER_SECONDS)
            except queue.Empty:
                self._kill()
                message = f"the model's chat template ran for more than {RENDER_SECONDS:g} s; {FIX}"
                raise EdgespecError(message) from None
            except OSError:  # the worker died while reading the request
                line = None
            if line is None:  # killed by the system (out of memory), or crashed
                self._kill()
                raise EdgespecError(f"the model's chat template crashed its renderer; {FIX}")
            return json.loads(line)

    def _start(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, str(WORKER), str(RENDER_MEMORY)],
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


_worker = _Worker()


def render(
    template: str,
    messages: list[Message],
    *,
    bos_token: str = "",
    eos_token: str = "",
    max_chars: int,
    tools: list[dict] | None = None,
) -> str:
    """The prompt text for `messages` (and `tools`, for a template that takes them), ending
    where the assistant's answer begins. A text longer than max_chars is refused (see
    engine.MAX_CHARS_PER_TOKEN)."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise EdgespecError("each chat message must be a dict with string 'role' and 'content'")
    request = dict(
        template=template, messages=messages, tools=tools, bos_token=bos_token, eos_token=eos_token, max_chars=max_chars
    )
    answer = _worker.ask(request)
    if "too_long" in answer:
        raise PromptTooLong(answer["too_long"])
    if "error" in answer:
        raise EdgespecError(f"the model's chat template failed ({answer['error']}); {FIX}")
    return answer["text"]


class PromptTooLong(Exception):
    """The rendered prompt has more characters than the context could hold tokens."""

    def __init__(self, n_chars: int) -> None:
        super().__init__(n_chars)
        self.n_chars = n_chars
