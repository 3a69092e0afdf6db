"""What the server's APIs share: a Job (a Request and how its client wants the answer), the
answer read as Pieces (text and tool calls apart, what is ready taken together), the error a
request is refused with, and Dialect, the one thing each API (OpenAI's chat completions,
Anthropic's Messages, OpenAI's Responses) writes: its request translated onto Request, and
its shapes for answers, streams and errors. The engine path behind them is one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from starlette.responses import JSONResponse

from ..errors import PromptExceedsContext
from ..logprobs import TokenLogprob
from ..request import Request, RequestError
from ..run import Run
from ..stats import LOOPING, Stats
from ..tools import ToolCall

log = logging.getLogger("edgespec.serve")
MAX_ANSWERS = 4  # answers to one request at most (OpenAI's n and best_of, llama-server's n_cmpl: its 4 slots)


class ApiError(Exception):
    """A request the API refuses: its HTTP status, the field at fault, and a code a client
    may act on (context_length_exceeded)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class ContextExceeded(ApiError):
    """The prompt does not fit the server's context (the engine's PromptExceedsContext)."""

    def __init__(self, error: PromptExceedsContext) -> None:
        super().__init__(400, str(error), code="context_length_exceeded")  # the code clients act on
        self.size, self.n_ctx, self.n_seq = error.size, error.n_ctx, error.n_seq


@dataclass(eq=False)  # each job is itself (kept in a set)
class Job:
    """One request's generation: its request, how many answers and how the client wants them,
    and the events the worker sends back to the event loop, a queue per answer (they may be made
    side by side): its Run once started, its Events, then None; or an ApiError instead (the
    answers after it are not read), or None alone where the client left before it began."""

    request: Request
    stream: bool = False
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    count: int = 1  # answers to the one prompt (OpenAI's n or best_of, llama-server's n_cmpl)
    returned: int | None = None  # best_of: only this many, of the highest log-probability per token
    scored_only_to_rank: bool = False  # best_of asked for no log-probabilities: they are not shown
    echo: bool = False  # OpenAI completions' echo: the prompt comes back before each answer
    cancelled: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop | None = None
    events: list[asyncio.Queue] = field(default_factory=list)  # one per answer

    def __post_init__(self) -> None:
        if self.stream:  # its first token is shown as it comes: planned to come soon (Request.streamed)
            self.request = replace(self.request, streamed=True)

    def send(self, item, index: int = 0) -> None:
        """From the worker thread to the request's handler: an event of answer `index`."""
        try:
            self.loop.call_soon_threadsafe(self.events[index].put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutting down)
            self.cancelled.set()


def refused(error: RequestError) -> ApiError:
    return ApiError(400, str(error), error.param)


@dataclass
class Piece:
    """What an answer added since the last piece: text to show and the tool calls it completed.
    stats: the generation's live statistics (final where done); logprobs: of the piece's tokens,
    where the request asked for them."""

    text: str
    calls: list[ToolCall]
    stats: Stats
    done: bool
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Answer:
    """A job's events as pieces: the events that are ready go together (a round's tokens come
    at once), tool calls are read apart from the text (the request's call parser). stats: the
    run's live statistics, from its start (the prompt's length is known before its prefill)."""

    def __init__(self, job: Job, run: Run, index: int = 0) -> None:
        """index: which of the job's answers (Job.count) this is."""
        self.job, self.run, self.stats, self.index = job, run, run.stats, index
        self.parser = job.request.call_parser()
        self.id, self.created = secrets.token_hex(12), int(time.time())  # each API prefixes the id its way

    async def following(self) -> Answer | None:
        """The job's next answer, once this one was read to its end (None: there is none, the
        client left); an ApiError if it could not start."""
        started = await self.job.events[self.index + 1].get() if self.index + 1 < self.job.count else None
        if isinstance(started, ApiError):
            raise started
        return None if started is None else Answer(self.job, started, self.index + 1)

    @property
    def calls(self) -> list[ToolCall]:
        """The calls read so far."""
        return self.parser.calls if self.parser is not None else []

    async def pieces(self) -> AsyncIterator[Piece]:
        """The pieces until the last (done); an ApiError if generation failed on the way."""
        queue = self.job.events[self.index]
        pending = [await queue.get()]
        while True:
            while pending[-1] is not None and not queue.empty():
                pending.append(queue.get_nowait())
            done = pending[-1] is None
            events = [e for e in pending if e is not None]
            if failure := next((e for e in events if isinstance(e, ApiError)), None):
                raise failure
            text, calls = self._split("".join(e.text for e in events), last=done)
            yield Piece(text, calls, self.stats, done, [e.logprob for e in events if e.logprob is not None])
            if done:
                return
            pending = [await queue.get()]

    async def whole(self) -> Piece:
        """The answer in one piece."""
        text, calls, logprobs = [], [], []
        async for piece in self.pieces():
            text.append(piece.text)
            calls += piece.calls
            logprobs += piece.logprobs
        return Piece("".join(text), calls, self.stats, True, logprobs)

    def _split(self, text: str, *, last: bool) -> tuple[str, list[ToolCall]]:
        return self.parser.split(text, last=last) if self.parser is not None else (text, [])


class Dialect:
    """One HTTP API over the engine: what it reads (job) and how it answers (whole, chunks, error)."""

    media_type = "text/event-stream"  # of its streams

    def job(self, body: dict) -> Job:
        """The job of a request body; ApiError naming the first field that is wrong."""
        raise NotImplementedError

    async def whole(self, answer: Answer) -> dict:
        """The answer as one JSON body."""
        raise NotImplementedError

    def chunks(self, answer: Answer) -> AsyncIterator[str]:
        """The answer as server-sent events."""
        raise NotImplementedError

    def error(self, error: ApiError) -> JSONResponse:
        """A refusal in this API's error JSON."""
        return JSONResponse({"error": _openai_error(error)}, status_code=error.status)

    def stream_error(self, error: ApiError) -> str:
        """A failure after the stream began, as this API's event."""
        return sse({"error": _openai_error(error)})

    def keepalive(self) -> str:
        """What keeps a silent stream open (a comment, which SSE readers skip)."""
        return ": keep-alive\n\n"


def _openai_error(error: ApiError) -> dict:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"message": str(error), "type": kind, "param": error.param, "code": error.code}


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event (named, for the APIs whose clients read the name)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def log_answer(stats: Stats) -> None:
    log.info(
        "answered: %d+%d tokens (%d cached), %.1f tok/s, %s, finish %s",
        stats.n_prompt,
        stats.n_tokens,
        stats.n_prompt_cached,
        stats.tokens_per_s,
        ", ".join(f"{k} {v}" for k, v in sorted(stats.rounds_by_source.items())) or "no rounds",
        stats.finish_reason,
    )
    if stats.finish_reason == "context":
        log.warning("the context window is full: the answer was cut; start the server with a larger --ctx")
    if stats.repeated_tokens >= LOOPING:
        log.warning(
            "the answer's last %d tokens repeat one %d-token span: the model was looping"
            " (a request's max_tokens, or serve --max-tokens, ends such answers sooner)",
            stats.repeated_tokens,
            stats.repeat_period,
        )
