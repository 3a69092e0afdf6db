"""Ollama's API, what many local apps speak only (Open WebUI, Continue's and Zed's Ollama
providers, the `ollama` Python and JS libraries): POST /api/chat and /api/generate, answered as
NDJSON lines by default (`stream: false`: one object), and the model endpoints /api/tags,
/api/show, /api/ps and /api/version (ollama_models).

A chat's `messages` (tool calls with object arguments, tool results), `tools`, `format` ("json"
or a JSON schema) and `options` (temperature, top_k, top_p, min_p, seed, num_predict, stop and
the penalties: see api_body.sampling_of) are translated onto Request; a generate's `prompt` is
rendered with the chat template (and its `system`) unless `raw`, and a `suffix` makes it a
fill-in-the-middle. Load-time options (num_ctx, num_thread, num_gpu, ...) and keep_alive are
accepted and left to the server's own settings (one model stays loaded). `think` is refused
as Ollama refuses it for a model that does not think; images, `template` and `context` are
refused. Every last line carries Ollama's counts and durations (nanoseconds), and ours,
`speculative`. Errors are Ollama's `{"error": message}`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

from starlette.responses import JSONResponse

from ..engine import Engine
from ..fim import Infill
from ..request import Request, RequestError, stop_strings
from ..stats import Stats
from ..tools import ToolCall
from .answers import Answer, ApiError, Dialect, Job, refused
from .api_body import json_field, own_fields, sampling_of

VERSION = "0.12.0"  # the Ollama API these endpoints follow (clients check it)
DONE_REASONS = {"length": "length", "context": "length"}  # else "stop"
QUANTIZATION = re.compile(r"(?i)\b(I?Q\d[\w]*?|F16|BF16|F32)(?=\.gguf$|[-.]|$)")
NANOSECONDS = 1e9


def request_of(body: dict, *, chat: bool) -> Request:
    """The Request of an /api/chat (chat=True) or /api/generate body; RequestError naming the
    first field that is wrong."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise RequestError("'options' must be an object", "options")
    if body.get("think"):
        raise RequestError("'think': this model does not think; leave it out", "think")
    for field in ("images", "template", "context"):
        if body.get(field):
            raise RequestError(f"'{field}' is not supported by edgespec; leave it out", field)
    predict = json_field(options, "num_predict", (int,), -1)
    if predict < -2:
        raise RequestError("'options.num_predict' must be -1 (no limit), -2 (fill the context) or more", "num_predict")
    schema = _format(body.get("format"))
    prompt, raw = (_messages(body), False) if chat else _generate_prompt(body)
    own = own_fields(body) | {"sets_temperature": options.get("temperature") is not None}
    tools = {"tools": body["tools"]} if chat and body.get("tools") else {}
    return Request(
        prompt,
        sampling_of(options),
        max_tokens=None if predict < 0 else predict,
        stop=stop_strings(options.get("stop"), "stop"),
        raw=raw,
        json_schema=schema,
        **tools,
        **own,
    )


def _format(value) -> dict | None:
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "object"}
    if isinstance(value, dict):
        return value
    raise RequestError("'format' must be \"json\" or a JSON schema", "format")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    chat = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), str):
            raise RequestError(f"{where} must be an object with a string 'role' and 'content'", where)
        if m.get("images"):
            raise RequestError(f"{where}.images: edgespec reads text only", f"{where}.images")
        message = {"role": m["role"], "content": m.get("content") or ""}
        if calls := m.get("tool_calls"):  # an assistant's earlier calls, their arguments objects
            if not isinstance(calls, list) or not all(isinstance(c, dict) and "function" in c for c in calls):
                raise RequestError(f"{where}.tool_calls must be a list of calls", f"{where}.tool_calls")
            message["tool_calls"] = [{"type": "function", "function": c["function"]} for c in calls]
        chat.append(message)
    return chat


def _generate_prompt(body: dict) -> tuple[str | list[dict] | Infill, bool]:
    """A generate's prompt, and whether it is raw: a fill-in-the-middle where a suffix is given,
    the text as it is where `raw`, else one user message (after the `system` one) to template."""
    prompt = json_field(body, "prompt", (str,), "")
    if suffix := json_field(body, "suffix", (str,)):
        return Infill.at_cursor(prompt, suffix), False
    if json_field(body, "raw", (bool,), False):
        return prompt, True
    system = json_field(body, "system", (str,))
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}], False


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def counts(stats: Stats) -> dict:
    """Ollama's done fields: why it ended, the tokens and their durations in nanoseconds."""
    return {
        "done_reason": DONE_REASONS.get(stats.finish_reason, "stop"),
        "total_duration": int((stats.prefill_s + stats.decode_s) * NANOSECONDS),
        "load_duration": 0,
        "prompt_eval_count": stats.n_prompt,
        "prompt_eval_duration": int(stats.prefill_s * NANOSECONDS),
        "eval_count": stats.n_tokens,
        "eval_duration": int(stats.decode_s * NANOSECONDS),
        "speculative": stats.as_dict(),
    }


class Ollama(Dialect):
    """chat=True: /api/chat; False: /api/generate."""

    media_type = "application/x-ndjson"

    def __init__(self, model: str, *, chat: bool) -> None:
        self.model, self.chat = model, chat

    def job(self, body: dict) -> Job:
        try:
            request = request_of(body, chat=self.chat)
            return Job(request, json_field(body, "stream", (bool,), True))
        except RequestError as e:
            raise refused(e) from None

    def loads_only(self, body: dict) -> dict | None:
        """Ollama's answer to a generate without a prompt (or a chat without messages): the model
        is loaded, nothing is generated."""
        asked = body.get("messages") if self.chat else body.get("prompt") or body.get("suffix")
        if asked:
            return None
        empty = {"message": {"role": "assistant", "content": ""}} if self.chat else {"response": ""}
        return {"model": self.model, "created_at": _now(), **empty, "done": True, "done_reason": "load"}

    async def whole(self, answer: Answer) -> dict:
        piece = await answer.whole()
        return self._line(piece.text, piece.calls) | {"done": True} | counts(answer.stats)

    async def chunks(self, answer: Answer) -> AsyncIterator[str]:
        async for piece in answer.pieces():
            if piece.text or piece.calls:
                yield _ndjson(self._line(piece.text, piece.calls) | {"done": False})
        yield _ndjson(self._line("", []) | {"done": True} | counts(answer.stats))

    def _line(self, text: str, calls: list[ToolCall]) -> dict:
        if not self.chat:
            return {"model": self.model, "created_at": _now(), "response": text}
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": _arguments(c)}} for c in calls]
        return {"model": self.model, "created_at": _now(), "message": message}

    def error(self, error: ApiError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=error.status)

    def stream_error(self, error: ApiError) -> str:
        return _ndjson({"error": str(error)})

    def keepalive(self) -> str:
        return ""  # (NDJSON has no comments; Ollama's own server sends nothing while it reads a prompt)


def _arguments(call: ToolCall) -> dict:
    """A call's arguments as the object Ollama's clients read (the parser checked the JSON)."""
    arguments = json.loads(call.arguments)
    return arguments if isinstance(arguments, dict) else {"value": arguments}


def _ndjson(data: dict) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n"


class OllamaModels:
    """/api/tags, /api/show, /api/ps and /api/version over the one model the server holds."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine, self.name = engine, name
        self._digest: str | None = None  # the file's sha256, read once, when first asked

    def digest(self) -> str:
        if self._digest is None:
            sha = hashlib.sha256()
            with open(self.engine.target.path, "rb") as f:
                while block := f.read(1 << 20):
                    sha.update(block)
            self._digest = sha.hexdigest()
        return self._digest

    def details(self) -> dict:
        target = self.engine.target
        family = target.metadata("general.architecture") or "unknown"
        found = QUANTIZATION.search(target.path.name)
        return {
            "parent_model": "",
            "format": "gguf",
            "family": family,
            "families": [family],
            "parameter_size": target.metadata("general.size_label") or "",
            "quantization_level": found.group(1).upper() if found else "",
        }

    def entry(self) -> dict:
        target = self.engine.target
        modified = datetime.fromtimestamp(target.path.stat().st_mtime, UTC).isoformat().replace("+00:00", "Z")
        size = target.path.stat().st_size
        return {"name": self.name, "model": self.name, "modified_at": modified, "size": size, "digest": self.digest()}

    def tags(self) -> dict:
        return {"models": [self.entry() | {"details": self.details()}]}

    def running(self) -> dict:
        """/api/ps: the model, loaded for as long as the server runs."""
        until = (datetime.now(UTC) + timedelta(days=365)).isoformat().replace("+00:00", "Z")
        entry = self.entry() | {"details": self.details(), "expires_at": until, "size_vram": 0}
        return {"models": [entry | {"context_length": self.engine.target.n_ctx}]}

    def show(self) -> dict:
        target = self.engine.target
        family = self.details()["family"]
        capabilities = ["completion", "tools"] + (["insert"] if not target.fim.missing() else [])
        info = {
            "general.architecture": family,
            f"{family}.context_length": target.n_ctx_train,
            "tokenizer.ggml.vocab_size": target.n_vocab,
        }
        return {
            "modelfile": f"FROM {target.path}\n",
            "parameters": "",
            "template": target.chat_template() or "",
            "details": self.details(),
            "model_info": info,
            "capabilities": capabilities,
            "modified_at": self.entry()["modified_at"],
        }

    @staticmethod
    def version() -> dict:
        return {"version": VERSION}
