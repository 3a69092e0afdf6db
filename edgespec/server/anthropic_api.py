"""Anthropic's Messages API (/v1/messages, what Claude Code speaks): the request translated
onto Request, the answer as a message of text and tool_use blocks, streamed as Anthropic's
SSE events, errors in Anthropic's error JSON.

output_config.format (a JSON schema) constrains the answer as response_format does on chat
completions; temperature, top_p and top_k are read (Anthropic's SDK no longer sends them:
extra_body does). Fields the engine has no use for (thinking, context_management,
output_config's effort, metadata, cache_control on blocks, ...) are accepted and ignored;
server tools (web search, code execution) are left out with a line in the log.
Claude Code's first system block, `x-anthropic-billing-header: ...; cch=...;`, changes with
every request and would make every prompt new to the prompt cache: it is dropped (vLLM and
ollama do the same).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse

from ..request import Request, RequestError, stop_strings
from ..stats import Stats
from ..tools import ToolCall
from .answers import Answer, ApiError, ContextExceeded, Dialect, Job, log, refused, sse
from .api_body import answer_limit, json_field, own_fields, sampling_of

BILLING_HEADER = "x-anthropic-billing-header:"
STOP_REASONS = {"stop": "end_turn", "stop_string": "stop_sequence", "length": "max_tokens", "context": "max_tokens"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
}
IGNORED_BLOCKS = ("thinking", "redacted_thinking")  # an assistant's reasoning: nothing to render


def request_of(body: dict, *, counting: bool = False) -> Request:
    """The Request of a Messages body; RequestError naming the first field that is wrong.
    counting: for count_tokens, which has no max_tokens."""
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    max_tokens = None
    if not counting:
        max_tokens = answer_limit(body, "max_tokens")
        if max_tokens is None:
            raise RequestError("'max_tokens' is required (the Messages API asks for it)", "max_tokens")
    return Request(
        messages,
        sampling_of(body),
        max_tokens=max_tokens,
        stop=stop_strings(body.get("stop_sequences"), "stop_sequences"),
        json_schema=_schema(body),
        **_tools(body),
        **own_fields(body),
    )


def _schema(body: dict) -> dict | None:
    """The JSON schema the answer must match: output_config.format (Anthropic's structured output)."""
    config = body.get("output_config") or {}
    form = config.get("format") if isinstance(config, dict) else None
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise RequestError(
            '\'output_config.format\' must be {"type": "json_schema", "schema": {...}}', "output_config.format"
        )
    return form["schema"]


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        blocks = [system]
    elif isinstance(system, list) and all(_is_text(b) for b in system):
        blocks = [b["text"] for b in system]
    else:
        raise RequestError("'system' must be a string or a list of text blocks", "system")
    text = "\n\n".join(b for b in blocks if not b.startswith(BILLING_HEADER))
    return [{"role": "system", "content": text}] if text else []


def _is_text(block) -> bool:
    return isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)


def _messages(messages) -> list[dict]:
    """Anthropic's turns as the chat messages Request takes: tool_use blocks become an
    assistant's tool_calls, tool_result blocks the tool messages that answer them."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        # system turns between the others: Claude Code sends them (its mid-conversation-system beta)
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise RequestError(f"{where} must be an object with role 'user', 'assistant' or 'system'", where)
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(f"{where}.content must be a string or a list of blocks", f"{where}.content")
        texts, calls = [], []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and _is_text(block):
                texts.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append(_call(block, at))
            elif kind == "tool_result" and m["role"] == "user":
                out.append(_result(block, at))
            elif kind not in IGNORED_BLOCKS:
                raise RequestError(f"{at}: a '{kind}' block is not supported here; edgespec reads text only", at)
        message = {"role": m["role"], "content": "\n\n".join(texts)}
        if calls:
            out.append(message | {"tool_calls": calls})
        elif texts:
            out.append(message)
    return out


def _call(block: dict, at: str) -> dict:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
        raise RequestError(f"{at}: a tool_use block needs a string 'id' and 'name'", at)
    arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _result(block: dict, at: str) -> dict:
    content = block.get("content")
    if isinstance(content, list):
        if not all(_is_text(b) for b in content):
            raise RequestError(f"{at}: a tool_result's content must be a string or text blocks", at)
        content = "\n\n".join(b["text"] for b in content)
    text = content if isinstance(content, str) else ""
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text}


def _tools(body: dict) -> dict:
    """Request's tools, tool_choice and parallel_tool_calls of Anthropic's `tools` and `tool_choice`."""
    tools = body.get("tools")
    if not tools:
        return {}
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", "tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{i}] must be an object with a string 'name'", f"tools[{i}]")
        if tool.get("type", "custom") != "custom":  # a server tool (web search, bash, ...): Anthropic runs those
            log.info("tool %s of type %s left out: edgespec runs no server tools", tool["name"], tool["type"])
            continue
        function = {"name": tool["name"], "description": tool.get("description", "")}
        functions.append({"type": "function", "function": function | {"parameters": tool.get("input_schema")}})
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, dict):
        raise RequestError('\'tool_choice\' must be an object such as {"type": "auto"}', "tool_choice")
    modes = {"auto": "auto", "any": "required", "none": "none"}
    kind = choice.get("type")
    if kind == "tool":
        tool_choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif kind in modes:
        tool_choice = modes[kind]
    else:
        raise RequestError("'tool_choice.type' must be auto, any, tool or none", "tool_choice")
    parallel = not json_field(choice, "disable_parallel_tool_use", (bool,), False)
    return {"tools": functions, "tool_choice": tool_choice, "parallel_tool_calls": parallel} if functions else {}


def usage(stats: Stats) -> dict:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache."""
    cached = stats.n_prompt_cached
    return {
        "input_tokens": stats.n_prompt - cached,
        "output_tokens": stats.n_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_use(call: ToolCall) -> dict:
    arguments = json.loads(call.arguments)
    arguments = arguments if isinstance(arguments, dict) else {"value": arguments}  # input is an object
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


class Messages(Dialect):
    def __init__(self, model: str) -> None:
        self.model = model

    def job(self, body: dict) -> Job:
        try:
            request = request_of(body)
            stream = json_field(body, "stream", (bool,), False)
        except RequestError as e:
            raise refused(e) from None
        return Job(request, stream)

    def _stop(self, answer: Answer) -> dict:
        stats = answer.stats
        reason = "tool_use" if answer.calls else STOP_REASONS.get(stats.finish_reason, "end_turn")
        return {"stop_reason": reason, "stop_sequence": stats.stop_string if reason == "stop_sequence" else None}

    def _message(self, answer: Answer, content: list[dict]) -> dict:
        return {
            "id": f"msg_{answer.id}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(answer.stats),
        }

    async def whole(self, answer: Answer) -> dict:
        piece = await answer.whole()
        content = ([{"type": "text", "text": piece.text}] if piece.text else []) + [_tool_use(c) for c in piece.calls]
        return self._message(answer, content) | self._stop(answer) | {"speculative": answer.stats.as_dict()}

    async def chunks(self, answer: Answer) -> AsyncIterator[str]:
        """message_start; a content block per text run and per tool call (start, deltas, stop);
        message_delta with the stop reason and usage; message_stop."""
        yield sse({"type": "message_start", "message": self._message(answer, [])}, "message_start")
        index, text_open = 0, False
        async for piece in answer.pieces():
            if piece.text:
                if not text_open:
                    yield _block_event("content_block_start", index, content_block={"type": "text", "text": ""})
                    text_open = True
                yield _block_event("content_block_delta", index, delta={"type": "text_delta", "text": piece.text})
            for call in piece.calls:
                if text_open:
                    yield _block_event("content_block_stop", index)
                    index, text_open = index + 1, False
                block = _tool_use(call)
                yield _block_event("content_block_start", index, content_block=block | {"input": {}})
                arguments = json.dumps(block["input"], ensure_ascii=False)
                yield _block_event(
                    "content_block_delta", index, delta={"type": "input_json_delta", "partial_json": arguments}
                )
                yield _block_event("content_block_stop", index)
                index += 1
        if text_open:
            yield _block_event("content_block_stop", index)
        closing = {"type": "message_delta", "delta": self._stop(answer), "usage": usage(answer.stats)}
        yield sse(closing | {"speculative": answer.stats.as_dict()}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")

    def error(self, error: ApiError) -> JSONResponse:
        return JSONResponse(_error(error), status_code=error.status)

    def stream_error(self, error: ApiError) -> str:
        return sse(_error(error), "error")

    def keepalive(self) -> str:
        return sse({"type": "ping"}, "ping")  # Anthropic's own keep-alive event


def _block_event(kind: str, index: int, **fields) -> str:
    return sse({"type": kind, "index": index} | fields, kind)


def _error(error: ApiError) -> dict:
    message = str(error)
    if isinstance(error, ContextExceeded):  # in Anthropic's words, which Claude Code looks for
        fix = "a larger --ctx" + (", or --parallel 1 (one request with all of it)" if error.n_seq > 1 else "")
        message = f"prompt is too long: {error.size} > {error.n_ctx} maximum; start edgespec serve with {fix}"
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
