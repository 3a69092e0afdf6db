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
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import tools
from .controller import MODES
from .engine import Engine, Event
from .engine_thread import EngineThread
from .errors import EdgespecError
from .stats import Stats

MAX_BODY = 8 << 20  # bytes: a whole source file as a prediction fits many times over
MAX_STOP = 16  # stop strings per request
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
    """One generation: its parameters, and the events the worker sends back to the
    event loop (Events, then None; or one ApiError)."""

    request: ApiRequest
    cancelled: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None

    def send(self, item) -> None:
        """From the worker thread to the request's handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutting down)
            self.cancelled.set()


def _text(content, param: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"'{param}' must be a string or a list of text parts", param)


def _get(body: dict, name: str, kinds: tuple, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(
            {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}[k] for k in kinds
        )
        raise ApiError(400, f"'{name}' must be {names}", name)
    return value


# Engine.stream's keyword arguments that a request may set (unset: the engine's defaults)
ENGINE_OPTIONS = (
    "max_tokens",
    "stop",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "draft_mode",
    "gamma",
    "prediction",
    "json_schema",
    "grammar",
)


@dataclass
class ApiRequest:
    """One request to /v1/chat/completions or /v1/completions, validated: what edgespec
    takes of OpenAI's schema (and llama-server's extensions) is read in from_json(),
    and engine_options() gives Engine.stream's arguments (as vLLM's to_sampling_params)."""

    prompt: str | list[dict]  # a completion's text, or the chat's messages
    raw: bool = False  # a completion: the prompt is sent as it is, no chat template
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    max_tokens: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    draft_mode: str | None = None
    gamma: int | str | None = None
    tools: list[dict] | None = None
    tool_choice: tools.ToolChoice | None = None
    parallel_tool_calls: bool = True
    prediction: str | None = None  # OpenAI's Predicted Outputs
    json_schema: dict | None = None  # response_format json_schema / json_object, or llama-server's json_schema
    grammar: str | None = None  # llama-server's GBNF grammar

    @classmethod
    def from_json(cls, body: dict, *, chat: bool) -> ApiRequest:
        """The request in `body`, or ApiError(400) naming the first field that is wrong."""
        request = cls(cls._chat_messages(body) if chat else cls._completion_prompt(body), raw=not chat)
        n = _get(body, "n", (int,), 1)
        if n != 1:
            raise ApiError(400, "only n=1 is supported: one answer per request", "n")
        for unsupported in ("logprobs", "functions", "echo", "suffix"):
            if body.get(unsupported) not in (None, False, [], 0, ""):
                raise ApiError(400, f"'{unsupported}' is not supported by edgespec", unsupported)
        request.stream = _get(body, "stream", (bool,), False)
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        request.include_usage = bool(_get(stream_options, "include_usage", (bool,), False))
        stop = body.get("stop")
        request.stop = [stop] if isinstance(stop, str) else stop
        if request.stop is not None and not (
            isinstance(request.stop, list) and all(isinstance(s, str) for s in request.stop)
        ):
            raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
        if request.stop and len(request.stop) > MAX_STOP:
            raise ApiError(400, f"at most {MAX_STOP} stop strings", "stop")
        request.max_tokens = _get(body, "max_completion_tokens", (int,)) or _get(body, "max_tokens", (int,))
        for name in ("temperature", "top_p", "min_p"):
            setattr(request, name, _get(body, name, (int, float)))
        request.top_k, request.seed = _get(body, "top_k", (int,)), _get(body, "seed", (int,))
        request.draft_mode = _get(body, "draft_mode", (str,))
        if request.draft_mode is not None and request.draft_mode not in MODES:
            raise ApiError(400, f"'draft_mode' must be one of {', '.join(MODES)}", "draft_mode")
        request.gamma = body.get("gamma")
        if request.gamma not in (None, "auto") and (
            isinstance(request.gamma, bool) or not isinstance(request.gamma, int)
        ):
            raise ApiError(400, "'gamma' must be an integer or \"auto\"", "gamma")
        if body.get("tools"):
            try:
                request.tool_choice = tools.check(body["tools"], body.get("tool_choice"))
            except EdgespecError as e:
                raise ApiError(400, str(e), "tools") from None
            request.tools = body["tools"]
            request.parallel_tool_calls = _get(body, "parallel_tool_calls", (bool,), True)
        prediction = body.get("prediction")
        if prediction is not None:
            if not isinstance(prediction, dict) or prediction.get("type") != "content":
                raise ApiError(400, '\'prediction\' must be {"type": "content", "content": ...}', "prediction")
            request.prediction = _text(prediction.get("content"), "prediction.content")
        request.json_schema, request.grammar = _constraint(body)
        return request

    @staticmethod
    def _chat_messages(body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
            message = {"role": m["role"], "content": _text(m.get("content"), f"messages[{i}].content")}
            if m.get("tool_calls"):  # an assistant's earlier calls
                calls = m["tool_calls"]
                if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                    raise ApiError(
                        400, f"messages[{i}].tool_calls must be a list of calls", f"messages[{i}].tool_calls"
                    )
                message["tool_calls"] = calls
            if isinstance(m.get("tool_call_id"), str):  # a tool's result
                message["tool_call_id"] = m["tool_call_id"]
            chat.append(message)
        return chat

    @staticmethod
    def _completion_prompt(body: dict) -> str:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", "prompt")
        return prompt

    @property
    def predicted(self) -> bool:
        return self.prediction is not None

    def engine_options(self) -> dict:
        """Engine.stream's keyword arguments: what the request set (the rest: the engine's defaults)."""
        options = {name: getattr(self, name) for name in ENGINE_OPTIONS if getattr(self, name) is not None}
        if self.tools:
            options |= {"tools": self.tools, "tool_choice": self.tool_choice}
            options["parallel_tool_calls"] = self.parallel_tool_calls
        return options | ({"raw": True} if self.raw else {})


def _constraint(body: dict) -> tuple[dict | None, str | None]:
    """(json_schema, grammar) the answer must match: OpenAI's response_format, or
    llama-server's `json_schema` (a schema) and `grammar` (GBNF text) fields, at most one
    of them; Engine.stream checks and compiles them."""
    response_format, json_schema = body.get("response_format"), body.get("json_schema")
    if json_schema is not None and not isinstance(json_schema, dict):
        raise ApiError(400, "'json_schema' must be an object (a JSON schema)", "json_schema")
    grammar = _get(body, "grammar", (str,))
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is not None and kind != "text":
        if json_schema is not None or grammar is not None:
            raise ApiError(400, "give one of response_format, json_schema and grammar", "response_format")
        if kind == "json_object":
            json_schema = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ApiError(400, "'response_format.json_schema.schema' must be an object", "response_format")
            json_schema = spec["schema"]
        else:
            raise ApiError(400, "'response_format.type' must be text, json_object or json_schema", "response_format")
    if json_schema is not None and grammar is not None:
        raise ApiError(400, "give one of response_format, json_schema and grammar", "grammar")
    return json_schema, grammar


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
        engine.defer_rechecks = True  # the thread re-checks costs when idle
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
            events = self.engine.stream(job.request.prompt, **job.request.engine_options())
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

    def __init__(self, worker: Worker, model_name: str, draft_name: str | None, api_key: str | None) -> None:
        self.worker, self.model_name, self.draft_name, self.api_key = worker, model_name, draft_name, api_key

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

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        target = self.worker.engine.target
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "edgespec"}
        # the context as llama-server (meta) and vLLM (max_model_len) report it
        model |= {"draft": self.draft_name, "max_model_len": target.n_ctx}
        model["meta"] = {"n_ctx": target.n_ctx, "n_ctx_train": target.n_ctx_train, "n_vocab": target.n_vocab}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, "chat.completion")

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, "text_completion")

    async def _answer(self, request: Request, kind: str) -> Response:
        watcher = None
        try:
            job = Job(ApiRequest.from_json(await _json_body(request), chat=kind == "chat.completion"))
            self.worker.submit(job)
            watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
            first = await job.events.get()
            if first is None:  # the client left while its request waited for its turn
                log.info("%s %s: the client left before its answer started", request.method, request.url.path)
                return Response(status_code=499)
            if isinstance(first, ApiError):
                raise first
            reply = _Reply(kind, self.model_name, job)
            if job.request.stream:
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
        choice = job.request.tool_choice
        self.calls = None  # reads tool calls out of the answer, where tools may be called
        if choice is not None and choice.mode != "none":
            self.calls = tools.ToolCallParser(choice.opening, parallel=job.request.parallel_tool_calls)

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
        return {"usage": usage(stats, self.job.request.predicted), "speculative": stats.as_dict()}

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
                    if self.job.request.include_usage:
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


async def _json_body(request: Request) -> dict:
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


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
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
