"""`edgespec serve`: OpenAI's chat completions and completions, Anthropic's Messages API,
OpenAI's Responses API and llama-server's /completion and /infill (editors' code
completion) over one Engine.

One worker thread owns the engine (llama.cpp contexts are not shared between threads) and
answers up to --parallel requests at once, their passes decoded together, each in a sequence
of its own (../engine_thread.py, ../scheduler.py, ../sequences.py); the KV cache of the
prefix that consecutive requests share is reused by the engine. The event loop only reads,
validates and streams. Each API is a Dialect (answers.py): a translation of its request
onto the one Request type, and its shapes for the answer; the engine path behind them is
the same. Every answer carries its API's usage and a `speculative` object with what
speculation did.

Bad requests get the API's error JSON and one log line, never a traceback; the server
keeps serving after each.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from time import perf_counter

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import Engine
from ..engine_thread import EngineThread
from ..errors import EdgespecError, EngineFault, PromptExceedsContext
from ..fim import Infill
from ..passes import Pass
from ..request import Request, RequestError
from ..tokenizer import Tokenizer
from . import anthropic_api, llama_api, openai_api
from .answers import Answer, ApiError, ContextExceeded, Dialect, Job, log, log_answer, refused
from .llama_api import LlamaServer
from .metrics import Metrics, ServerLoad, resident_bytes
from .ollama_api import Ollama, OllamaModels
from .openai_api import OpenAIChat
from .responses_api import Responses

LLAMA_SERVER_PATHS = ("/infill", "/completion", "/tokenize", "/detokenize", "/apply-template", "/props")
MAX_BODY = 8 << 20  # bytes: a whole source file as a prediction fits many times over
KEEPALIVE_S = 15.0  # a stream silent this long gets a keep-alive


# --- the worker ---------------------------------------------------------------------


class Worker:
    """Owns the engine on its EngineThread: loads it, answers up to `parallel` jobs at once
    (editors' completions first; the rest in the order they came), and closes it."""

    def __init__(self, load: Callable[[], Engine], parallel: int = 1) -> None:
        self.engine: Engine | None = None
        self._unfinished: set[tuple[Job, int]] = set()  # answers started, not yet ended: told to stop on stop()
        self.metrics = Metrics()
        self.thread = EngineThread(parallel=parallel)
        self._loading = self.thread.submit(self._load, load)

    def _load(self, load: Callable[[], Engine]) -> Engine:
        engine = load()
        if loaded := engine.load_prompts():
            log.info("%d prompts of the last run's cache loaded from disk", loaded)
        self.engine = self.thread.engine = engine
        return engine

    def wait_loaded(self) -> Engine:
        """The loaded engine, or the loading error raised here."""
        return self._loading.result()

    def submit(self, job: Job) -> None:
        job.loop, job.events = asyncio.get_running_loop(), [asyncio.Queue() for _ in range(job.count)]
        self._start(job, 0, self._serve)

    def _start(self, job: Job, index: int, work: Callable[..., Iterator[Pass]], *args) -> None:
        """A task making the job's answer `index` (and, for _serve, maybe the ones after it)."""
        self._unfinished.add((job, index))
        self.thread.start(work, job, *args, interactive=isinstance(job.request.prompt, Infill))

    def stop(self) -> None:
        """Cancel what runs and what waits (each ends at its next round), close the engine,
        finish the thread."""
        for job, _ in list(self._unfinished):
            job.cancelled.set()
        self.thread.close(last=self._close)

    def _close(self) -> None:
        if self.engine is not None:
            if kept := self.engine.save_prompts():
                log.info("prompt cache kept on disk for the next start: %d MiB", kept >> 20)
            self.engine.close()
            self.engine = self.thread.engine = None

    def _serve(self, job: Job) -> Iterator[Pass]:
        """The job's answers, a pass at a time (an EngineThread task): one after another,
        each drafted from the one before; or, where this machine makes them side by side for much
        less (Engine.answers_together), the first here and each of the others in a task of its own
        (which waits for the first to read the prompt, then copies it: see sequences.py)."""
        count = job.count
        if self.engine.answers_together(count):
            for index in range(1, count):
                self._start(job, index, self._serve_beside, index)
            count = 1
        previous, start = "", perf_counter()
        try:
            for index in range(count):
                if job.cancelled.is_set():  # a client that left costs nothing more; its handler hears so
                    job.send(None, index)
                    return
                request = job.request.answer(index, previous, perf_counter() - start)
                previous = yield from self._answer(job, index, request)
                if previous is None:
                    return
        finally:
            self._unfinished.discard((job, 0))

    def _serve_beside(self, job: Job, index: int) -> Iterator[Pass]:
        """Answer `index` of a job whose answers are made side by side (an EngineThread task)."""
        try:
            if job.cancelled.is_set():
                job.send(None, index)
            else:
                yield from self._answer(job, index, job.request.answer(index, ""))
        finally:
            self._unfinished.discard((job, index))

    def load(self) -> ServerLoad:
        """Requests running and waiting, and the target's cache, now (read from any thread)."""
        running, waiting = self.thread.load
        target, cache = self.engine.target, self.engine.target.prompt_cache
        ram, size = (cache.in_ram, cache.size) if cache is not None else (0, 0)
        return ServerLoad(
            running,
            waiting,
            target.cells_used,
            target.n_ctx * target.n_seq,
            self.thread.idle_faults,
            resident_bytes(),
            {"ram": ram, "disk": size - ram},
        )

    def _answer(self, job: Job, index: int, request: Request) -> Iterator[Pass]:
        """Answer `index` of the job, a step at a time: its Run, its events, then None; returns the
        answer's text, or None where it failed (an ApiError sent instead)."""
        try:
            run = self.engine.start(request, cancelled=job.cancelled)
        except PromptExceedsContext as e:
            job.send(ContextExceeded(e), index)
            return None
        except Exception as e:  # the request's own fault is a 400, anything else a 500 (failure_of)
            job.send(failure_of(e, self.metrics), index)
            return None
        job.send(run, index)  # the request is good: its answer may begin before the prefill
        text = []
        steps = self.engine.steps(run)  # a cancelled run ends at its next prefill chunk or round
        try:
            for event in steps:
                if isinstance(event, Pass):
                    yield event  # decoded with the other runs' passes
                    continue
                job.send(event, index)
                text.append(event.text)
        except Exception as e:  # a grammar that stopped working is a 400; a decode that failed a 500
            job.send(failure_of(e, self.metrics), index)
            return None
        finally:
            steps.close()
        log_answer(run.stats)  # here, not where it is read: an answer whose client left is logged too
        self.metrics.add(run.stats)
        job.send(None, index)
        return "".join(text)


def failure_of(error: Exception, metrics: Metrics) -> ApiError:
    """What a failure while answering tells the client: the request's own fault (bad input the
    engine found: a parameter out of range, a template that refuses these messages, a grammar
    that stopped working) is a 400 naming it; anything else (an EngineFault, llama.cpp refusing,
    a bug of ours) is a 500 that says it is the server's, with the traceback in the log and a
    count in /metrics."""
    if isinstance(error, EdgespecError) and not isinstance(error, EngineFault):
        return ApiError(400, str(error))
    log.error("a request failed on the server's side", exc_info=error)
    metrics.fault()
    reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    return ApiError(500, f"the server failed on this request, not because of it ({reason}); see the server log")


# --- the HTTP API -----------------------------------------------------------------------


class Api:
    """The HTTP endpoints over one engine."""

    def __init__(
        self,
        worker: Worker,
        model_name: str,
        draft_name: str | None,
        api_key: str | None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        metrics: bool = False,
    ) -> None:
        """max_tokens: the cap of answers whose requests set no limit (None: until the model stops
        or the context is full). temperature: that of requests that set none (None: llama.cpp's
        default; Anthropic's SDK, and so Claude Code, sends none). metrics: GET /metrics
        (Prometheus' text format, see metrics.py)."""
        self.worker, self.model_name, self.draft_name, self.api_key = worker, model_name, draft_name, api_key
        self.metrics = metrics
        self.chat = OpenAIChat(model_name, chat=True)
        self.completion = OpenAIChat(model_name, chat=False)
        self.messages = anthropic_api.Messages(model_name)
        self.responses = Responses(model_name)
        engine = worker.wait_loaded()
        engine.defaults = replace(engine.defaults, max_tokens=max_tokens, temperature=temperature)
        n_ctx = engine.target.n_ctx
        if draft_name in (None, "auto", "heads"):  # what was found: a draft model's file, or the target's heads
            self.draft_name = engine.draft_name
        self.completion_native = LlamaServer(model_name, n_ctx, infill=False)
        self.infill = LlamaServer(model_name, n_ctx, infill=True)
        self.ollama_chat = Ollama(model_name, chat=True)
        self.ollama_generate = Ollama(model_name, chat=False)
        self.ollama_models = OllamaModels(engine, model_name)

    def app(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(app):
            yield
            await asyncio.to_thread(self.worker.stop)  # finish the engine's thread, which closes it

        def answer(dialect: Dialect):
            return partial(self._answer, dialect=dialect)  # starlette sees a partial's coroutine function

        routes = [
            Route("/health", self.health),
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", answer(self.chat), methods=["POST"]),
            Route("/v1/completions", answer(self.completion), methods=["POST"]),
            Route("/v1/messages", answer(self.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/responses", answer(self.responses), methods=["POST"]),
            Route("/completion", answer(self.completion_native), methods=["POST"]),  # llama-server's own
            Route("/infill", answer(self.infill), methods=["POST"]),
            Route("/tokenize", partial(self._vocabulary, work=llama_api.tokenize_body), methods=["POST"]),
            Route("/detokenize", partial(self._vocabulary, work=llama_api.detokenize_body), methods=["POST"]),
            Route("/apply-template", self.apply_template, methods=["POST"]),
            Route("/props", self.props),
            Route("/api/chat", answer(self.ollama_chat), methods=["POST"]),  # Ollama's
            Route("/api/generate", answer(self.ollama_generate), methods=["POST"]),
            Route("/api/tags", partial(self._ollama_models, view=OllamaModels.tags)),
            Route("/api/ps", partial(self._ollama_models, view=OllamaModels.running)),
            Route("/api/show", partial(self._ollama_models, view=OllamaModels.show), methods=["POST"]),
            Route("/api/version", partial(self._ollama_models, view=lambda _: OllamaModels.version())),
        ]
        if self.metrics:
            routes.append(Route("/metrics", self.prometheus))
        app = Starlette(routes=routes, lifespan=lifespan)
        app.add_middleware(_Guard, api_key=self.api_key, dialect_of=self.dialect_of)
        return app

    def dialect_of(self, path: str) -> Dialect:
        """The API a path belongs to (its refusals come in that API's error JSON)."""
        if path.startswith("/v1/messages"):
            return self.messages
        if path.startswith("/api/"):
            return self.ollama_chat
        return self.infill if path in LLAMA_SERVER_PATHS else self.chat

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: HttpRequest) -> Response:
        text = self.worker.metrics.text(self.worker.load())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: HttpRequest) -> Response:
        target = self.worker.engine.target
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "edgespec"}
        # the context as llama-server (meta) and vLLM (max_model_len) report it
        model |= {"draft": self.draft_name, "max_model_len": target.n_ctx}
        model["meta"] = {"n_ctx": target.n_ctx, "n_ctx_train": target.n_ctx_train, "n_vocab": target.n_vocab}
        return JSONResponse({"object": "list", "data": [model]})

    async def _ollama_models(self, request: HttpRequest, view: Callable[[OllamaModels], dict]) -> Response:
        """Ollama's model endpoints (a file's digest is read once, on a thread of its own)."""
        return JSONResponse(await asyncio.to_thread(view, self.ollama_models))

    async def props(self, request: HttpRequest) -> Response:
        return JSONResponse(llama_api.props(self.worker.engine, self.model_name, self.metrics))

    async def _vocabulary(self, request: HttpRequest, work: Callable[[dict, Tokenizer], dict]) -> Response:
        """/tokenize and /detokenize: the target's vocabulary only (read-only in llama.cpp, so not
        queued behind the engine's work, as in llama-server), on a thread of their own."""
        try:
            body = await _json_body(request)
            try:
                return JSONResponse(await asyncio.to_thread(work, body, self.worker.engine.target))
            except RequestError as e:
                raise refused(e) from None
        except ApiError as e:
            log.warning("%s %s: %d %s", request.method, request.url.path, e.status, e)
            return self.infill.error(e)

    async def apply_template(self, request: HttpRequest) -> Response:
        """llama-server's /apply-template: a chat completion body's prompt as text, rendered with
        the chat template (and its tools) on the engine's thread, as a request's would be."""
        try:
            try:
                chat = openai_api.request_of(await _json_body(request), chat=True)
            except RequestError as e:
                raise refused(e) from None
            render = partial(self.worker.engine.prompt_text, chat)
            try:
                return JSONResponse({"prompt": await asyncio.wrap_future(self.worker.thread.submit(render))})
            except Exception as e:  # a template refusing the messages is a 400, a bug a 500
                raise failure_of(e, self.worker.metrics) from None
        except ApiError as e:
            log.warning("%s %s: %d %s", request.method, request.url.path, e.status, e)
            return self.infill.error(e)

    async def count_tokens(self, request: HttpRequest) -> Response:
        """Anthropic's count_tokens: the prompt's tokens as the model reads them (rendered on the
        engine's thread, after what is queued there)."""
        try:
            try:
                counted = anthropic_api.request_of(await _json_body(request), counting=True)
            except RequestError as e:
                raise refused(e) from None
            count = partial(self.worker.engine.prompt_tokens, counted, fit=False)
            try:
                tokens = await asyncio.wrap_future(self.worker.thread.submit(count))
            except Exception as e:  # a template refusing the messages is a 400, a bug a 500
                raise failure_of(e, self.worker.metrics) from None
            return JSONResponse({"input_tokens": len(tokens)})
        except ApiError as e:
            log.warning("%s %s: %d %s", request.method, request.url.path, e.status, e)
            return self.messages.error(e)

    async def _answer(self, request: HttpRequest, dialect: Dialect) -> Response:
        watcher = None
        try:
            body = await _json_body(request)
            if isinstance(dialect, Ollama) and (loaded := dialect.loads_only(body)) is not None:
                return JSONResponse(loaded)  # (Ollama's way to load a model: a request without a prompt)
            job = dialect.job(body)
            self.worker.submit(job)
            watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
            started = await job.events[0].get()  # the Run once the request is checked
            if started is None:  # the client left while its request waited for its turn
                log.info("%s %s: the client left before its answer started", request.method, request.url.path)
                return Response(status_code=499)
            if isinstance(started, ApiError):
                raise started
            answer = Answer(job, started)
            if job.stream:
                watcher, streaming = None, watcher  # the stream owns it from here
                return StreamingResponse(
                    _stream(dialect, answer, streaming, self.worker.metrics), media_type=dialect.media_type
                )
            return JSONResponse(await dialect.whole(answer))
        except ApiError as e:
            log.warning("%s %s: %d %s", request.method, request.url.path, e.status, e)
            return dialect.error(e)
        except Exception as e:  # a bug of ours: a 500 saying so, its traceback in the log
            return dialect.error(failure_of(e, self.worker.metrics))
        finally:
            if watcher is not None:
                watcher.cancel()


async def _stream(dialect: Dialect, answer: Answer, watcher: asyncio.Task, metrics: Metrics) -> AsyncIterator[str]:
    """The dialect's events, a keep-alive whenever none came for KEEPALIVE_S (an agent's
    20k-token prompt takes minutes to read on a CPU, and clients give up on a silent stream);
    a failure on the way as the dialect's error event."""
    chunks, step = dialect.chunks(answer), None
    try:
        while True:
            step = asyncio.ensure_future(anext(chunks))
            while not (await asyncio.wait({step}, timeout=KEEPALIVE_S))[0]:
                yield dialect.keepalive()
            try:
                chunk = step.result()
            except StopAsyncIteration:
                break
            yield chunk
    except ApiError as e:
        log.warning("the answer failed while streaming: %s", e)
        yield dialect.stream_error(e)
    except Exception as e:  # a bug of ours midway: the dialect's error event, never a silent close
        yield dialect.stream_error(failure_of(e, metrics))
    finally:
        if step is not None:
            step.cancel()
        answer.job.cancelled.set()  # a no-op after the end; frees the engine if the client left
        watcher.cancel()


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
    """ASGI middleware: the API key on every endpoint (compared in constant time), as a bearer
    token or Anthropic's x-api-key header, and one log line for requests refused here."""

    def __init__(self, app, api_key: str | None, dialect_of: Callable[[str], Dialect]) -> None:
        self.app, self.api_key, self.dialect_of = app, api_key, dialect_of

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.api_key is not None:
            headers = dict(scope["headers"])
            bearer = headers.get(b"authorization", b"").removeprefix(b"Bearer ")
            given = headers.get(b"x-api-key", bearer)
            if not hmac.compare_digest(given, self.api_key.encode()):
                log.warning("%s %s: 401 missing or wrong API key", scope["method"], scope["path"])
                error = ApiError(
                    401,
                    "missing or wrong API key; send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                    code="invalid_api_key",
                )
                await self.dialect_of(scope["path"]).error(error)(scope, receive, send)
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
