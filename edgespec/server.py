"""`edgespec serve`: an OpenAI-compatible HTTP API over one Engine.

One worker thread owns the engine and runs requests one at a time, in arrival order
(llama.cpp contexts are not shared between threads; the KV cache of the prefix that
consecutive requests share is reused by the engine). The event loop only reads,
validates and streams. Every answer carries OpenAI's `usage` and a `speculative`
object with what speculation did.

Bad requests get OpenAI's error JSON and one log line, never a traceback; the server
keeps serving after each.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import tools
from .engine import Engine, Event
from .engine_thread import EngineThread
from .errors import EdgespecError
from .request import Request, RequestError, json_field
from .stats import LOOPING, Stats

MAX_BODY = 8 << 20  # bytes: a whole source file as a prediction fits many times over
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length", "context": "length"}

log = logging.getLogger("edgespec.serve")


class ApiError(Exception):
    """A request the API refuses, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def response(self) -> JSONResponse:
        error = {"message": str(self), "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status)


# --- requests -----------------------------------------------------------------------


@dataclass(eq=False)  # each job is itself (kept in a set)
class Job:
    """One generation: its request, how the client wants the answer, and the events the
    worker sends back to the event loop (Events, then None; or one ApiError)."""

    request: Request
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    cancelled: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None

    @classmethod
    def from_openai(cls, body: dict, *, chat: bool, max_tokens: int | None = None) -> Job:
        """The job of an OpenAI request body, or ApiError(400) naming the first field that is wrong.
        max_tokens: the cap of an answer the request sets no limit for (None: none)."""
        try:
            request = Request.from_openai(body, chat=chat)
            if request.max_tokens is None and max_tokens is not None:
                request = replace(request, max_tokens=max_tokens)
            stream = json_field(body, "stream", (bool,), False)
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise RequestError("'stream_options' must be an object", "stream_options")
            include_usage = json_field(options, "include_usage", (bool,), False)
        except RequestError as e:
            raise ApiError(400, str(e), e.param) from None
        return cls(request, stream, include_usage)

    def send(self, item) -> None:
        """From the worker thread to the request's handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutting down)
            self.cancelled.set()


# --- the worker ---------------------------------------------------------------------


class Worker:
    """Owns the engine on its EngineThread: loads it, runs jobs one at a time in the
    order they came, and closes it."""

    def __init__(self, load: Callable[[], Engine]) -> None:
        self.engine: Engine | None = None
        self.current: Job | None = None
        self._unfinished: set[Job] = set()  # submitted, not yet answered: told to stop on stop()
        self.thread = EngineThread()
        self._loading = self.thread.submit(self._load, load)

    def _load(self, load: Callable[[], Engine]) -> Engine:
        engine = load()
        self.engine = self.thread.engine = engine
        return engine

    def wait_loaded(self) -> Engine:
        """The loaded engine, or the loading error raised here."""
        return self._loading.result()

    def submit(self, job: Job) -> None:
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        self._unfinished.add(job)
        self.thread.submit(self._serve, job)

    def stop(self) -> None:
        """Cancel what runs and what waits (each ends at its next round), close the engine,
        finish the thread."""
        for job in list(self._unfinished):
            job.cancelled.set()
        self.thread.submit(self._close)
        self.thread.close()

    def _close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = self.thread.engine = None

    def _serve(self, job: Job) -> None:
        self.current = job
        try:
            if job.cancelled.is_set():  # a client that left while queued costs nothing
                job.send(None)
            else:
                self._generate(job)
        finally:
            self.current = None
            self._unfinished.discard(job)

    def _generate(self, job: Job) -> None:
        try:
            events = self.engine.stream(job.request)
        except EdgespecError as e:  # the prompt is too long, a parameter is out of range, ...
            job.send(ApiError(400, str(e)))
            return
        try:
            for event in events:
                job.send(event)
                if job.cancelled.is_set():  # the client left: free the engine at this round
                    break
        except EdgespecError as e:  # the request's grammar stopped working (see grammar.py)
            job.send(ApiError(400, str(e)))
        except Exception as e:  # a llama.cpp failure: answer 500, keep serving
            log.error("generation failed: %s: %s", type(e).__name__, e)
            job.send(ApiError(500, f"generation failed ({type(e).__name__})"))
        finally:
            events.close()
        job.send(None)


# --- responses ------------------------------------------------------------------------


def usage(stats: Stats, predicted: bool) -> dict:
    out = {
        "prompt_tokens": stats.n_prompt,
        "completion_tokens": stats.n_tokens,
        "total_tokens": stats.n_prompt + stats.n_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.n_prompt_cached},
    }
    if predicted:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": stats.accepted_prediction_tokens,
            "rejected_prediction_tokens": stats.rejected_prediction_tokens,
        }
    return out


class Api:
    """The HTTP endpoints over one engine."""

    def __init__(
        self,
        worker: Worker,
        model_name: str,
        draft_name: str | None,
        api_key: str | None,
        max_tokens: int | None = None,
    ) -> None:
        """max_tokens: the cap of answers whose requests set no limit (None: until the model stops
        or the context is full)."""
        self.worker, self.model_name, self.draft_name, self.api_key = worker, model_name, draft_name, api_key
        self.max_tokens = max_tokens

    def app(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(app):
            yield
            await asyncio.to_thread(self.worker.stop)  # finish the engine's thread, which closes it

        routes = [
            Route("/health", self.health),
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]
        app = Starlette(routes=routes, lifespan=lifespan)
        app.add_middleware(_Guard, api_key=self.api_key)
        return app

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: HttpRequest) -> Response:
        target = self.worker.engine.target
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "edgespec"}
        # the context as llama-server (meta) and vLLM (max_model_len) report it
        model |= {"draft": self.draft_name, "max_model_len": target.n_ctx}
        model["meta"] = {"n_ctx": target.n_ctx, "n_ctx_train": target.n_ctx_train, "n_vocab": target.n_vocab}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat(self, request: HttpRequest) -> Response:
        return await self._answer(request, "chat.completion")

    async def completions(self, request: HttpRequest) -> Response:
        return await self._answer(request, "text_completion")

    async def _answer(self, request: HttpRequest, kind: str) -> Response:
        watcher = None
        try:
            job = Job.from_openai(await _json_body(request), chat=kind == "chat.completion", max_tokens=self.max_tokens)
            self.worker.submit(job)
            watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
            first = await job.events.get()
            if first is None:  # the client left while its request waited for its turn
                log.info("%s %s: the client left before its answer started", request.method, request.url.path)
                return Response(status_code=499)
            if isinstance(first, ApiError):
                raise first
            reply = _Reply(kind, self.model_name, job)
            if job.stream:
                watcher, streaming = None, watcher  # the stream owns it from here
                return StreamingResponse(reply.chunks(first, streaming), media_type="text/event-stream")
            return JSONResponse(await reply.whole(first))
        except ApiError as e:
            log.warning("%s %s: %d %s", request.method, request.url.path, e.status, e)
            return e.response()
        except Exception as e:  # a bug of ours: one log line and a 500, no traceback to anyone
            log.error("%s %s: internal error %s: %s", request.method, request.url.path, type(e).__name__, e)
            return ApiError(500, "internal error; see the server log").response()
        finally:
            if watcher is not None:
                watcher.cancel()


class _Reply:
    """One answer in OpenAI's shapes: chat.completion(.chunk) or text_completion."""

    def __init__(self, kind: str, model: str, job: Job) -> None:
        self.kind, self.model, self.job = kind, model, job
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id, self.created = f"{prefix}-{secrets.token_hex(12)}", int(time.time())
        self.calls = job.request.call_parser()  # reads tool calls out of the answer, where tools may be called

    def _split(self, text: str, *, last: bool = False) -> tuple[str, list[tools.ToolCall]]:
        """The answer's new text -> (its text to show, the tool calls it completed)."""
        if self.calls is None:
            return text, []
        shown, calls = self.calls.feed(text)
        if last:
            rest, more = self.calls.finish()
            shown, calls = shown + rest, calls + more
        return shown, calls

    def _finish_reason(self, stats: Stats) -> str | None:
        return "tool_calls" if self.calls is not None and self.calls.calls else FINISH_REASONS.get(stats.finish_reason)

    def _envelope(self, object_kind: str, choices: list) -> dict:
        return {"id": self.id, "object": object_kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, text: str, finish: str | None, *, delta: bool, first: bool = False, calls=()) -> dict:
        if self.kind == "text_completion":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if not delta:
            message = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
            return {"index": 0, "message": message, "finish_reason": finish}
        out = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        if calls:  # each call whole, in one delta (clients join the pieces of a call by its index)
            numbered = [{"index": self.calls.calls.index(c)} | c.as_openai() for c in calls]
            out["tool_calls"] = numbered
        return {"index": 0, "delta": out, "finish_reason": finish}

    def _closing(self, stats: Stats) -> dict:
        return {"usage": usage(stats, self.job.request.prediction is not None), "speculative": stats.as_dict()}

    async def whole(self, first: Event) -> dict:
        text, event = [first.text], first
        while (item := await self.job.events.get()) is not None:
            if isinstance(item, ApiError):
                raise item
            text.append(item.text)
            event = item
        stats = event.stats
        _log_answer(stats)
        shown, calls = self._split("".join(text), last=True)
        choice = self._choice(shown, self._finish_reason(stats), delta=False, calls=calls)
        return self._envelope(self.kind, [choice]) | self._closing(stats)

    async def chunks(self, first: Event, watcher: asyncio.Task) -> AsyncIterator[str]:
        """SSE: text as it comes (what is ready is sent together), then the finish reason,
        the usage chunk if asked for, and [DONE]."""
        kind, event, opening = f"{self.kind}.chunk" if self.kind == "chat.completion" else self.kind, first, True
        try:
            pending = [first]
            while True:
                while not self.job.events.empty():  # the rest of a round came at once: one chunk
                    pending.append(self.job.events.get_nowait())
                ended = pending[-1] is None
                events = [e for e in pending if e is not None]
                failure = next((e for e in events if isinstance(e, ApiError)), None)
                if failure is not None:
                    yield _sse({"error": {"message": str(failure), "type": failure.type, "code": None}})
                    break
                if events or ended:
                    event = events[-1] if events else event
                    text, calls = self._split("".join(e.text for e in events), last=ended)
                    if text or calls or opening:
                        delta = self._choice(text, None, delta=True, first=opening, calls=calls)
                        yield _sse(self._envelope(kind, [delta]))
                        opening = False
                if ended:
                    stats = event.stats
                    _log_answer(stats)
                    finish = self._choice("", self._finish_reason(stats), delta=True)
                    yield _sse(self._envelope(kind, [finish]))
                    if self.job.include_usage:
                        yield _sse(self._envelope(kind, []) | self._closing(stats))
                    else:
                        yield _sse(self._envelope(kind, []) | {"speculative": stats.as_dict()})
                    break
                pending = [await self.job.events.get()]
            yield "data: [DONE]\n\n"
        finally:
            self.job.cancelled.set()  # a no-op after the end; frees the engine if the client left
            watcher.cancel()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _log_answer(stats: Stats) -> None:
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


async def _json_body(request: HttpRequest) -> dict:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
        raise ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


async def _cancel_on_disconnect(request: HttpRequest, job: Job) -> None:
    """A client that goes away frees the engine (at the next round boundary)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()


class _Guard:
    """ASGI middleware: the API key on every endpoint (compared in constant time), and
    one log line for requests refused here."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.api_key is not None:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"").decode("latin-1")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                log.warning("%s %s: 401 missing or wrong API key", scope["method"], scope["path"])
                error = ApiError(
                    401, "missing or wrong API key; send 'Authorization: Bearer KEY'", code="invalid_api_key"
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, or one sentence on why not (port in use, bad address)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP spelled out: asyncio switches Nagle off (TCP_NODELAY) only on sockets that
        # say so, and with it on, each streamed chunk would wait out the client's delayed ACK
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        raise EdgespecError(
            f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host"
        ) from None
    return sock


def serve(app: Starlette, sock: socket.socket) -> None:
    """Run until Ctrl+C (uvicorn shuts down cleanly on SIGINT and SIGTERM)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
