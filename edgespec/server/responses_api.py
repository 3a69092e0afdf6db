"""OpenAI's Responses API (/v1/responses, what Codex and the OpenAI Agents SDK speak): `input`
items translated onto Request, the answer as output items (a message, function calls),
streamed as response.* events.

Tools other than functions (custom, namespace, web_search, ...) are left out with a line in
the log. `store: false` is served statelessly; a stored response (the default) is kept in
memory, the last MAX_STORED, so that a request can continue it with previous_response_id.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..request import Request, RequestError
from ..stats import Stats
from ..tools import ToolCall
from .answers import Answer, ApiError, Dialect, Job, log, refused, sse
from .api_body import answer_limit, json_field, own_fields, sampling_of, text_of

MAX_STORED = 64  # responses kept for previous_response_id
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
SKIPPED_ITEMS = ("reasoning",)  # a model's reasoning summary: nothing to render


@dataclass(eq=False)
class ResponsesJob(Job):
    history: list[dict] = field(default_factory=list)  # the conversation without instructions, for a stored response
    store: bool = True


def messages_of(body: dict, previous: list[dict]) -> list[dict]:
    """The conversation of a Responses body as chat messages: instructions, the previous
    response's conversation, then `input`. Leading system and developer messages become one."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a string or a non-empty list of items", "input")
    out = list(previous)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "system", "assistant"):
                raise RequestError(f"{where}.role must be user, developer, system or assistant", where)
            out.append({"role": role, "content": text_of(item.get("content"), f"{where}.content", TEXT_PARTS)})
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item.get("arguments") if kind == "function_call" else json.dumps({"input": item.get("input")})
            if not isinstance(item.get("name"), str) or not isinstance(arguments, str):
                raise RequestError(f"{where}: a {kind} needs a string 'name' and 'arguments'", where)
            call = {"id": str(item.get("call_id")), "type": "function"}
            call["function"] = {"name": item["name"], "arguments": arguments}
            if out and out[-1]["role"] == "assistant":  # the calls of one turn, in one message
                out[-1] = out[-1] | {"tool_calls": [*out[-1].get("tool_calls", ()), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = text_of(item.get("output"), f"{where}.output", TEXT_PARTS)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id")), "content": output})
        elif kind not in SKIPPED_ITEMS:
            raise RequestError(f"{where}: items of type '{kind}' are not supported by edgespec", where)
    return out


def _leading_system(messages: list[dict]) -> list[dict]:
    """The system and developer messages at the start as one (templates want one, first)."""
    n = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if n < 2:
        return messages
    return [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:n])}, *messages[n:]]


def _tools(body: dict) -> dict:
    """Request's tools, tool_choice and parallel_tool_calls of the Responses API's (flat) function tools."""
    tools = body.get("tools")
    if not tools:
        return {}
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("'tools' must be a list of tools", "tools")
    functions = []
    for tool in tools:
        if tool.get("type") != "function":
            kind, name = tool.get("type"), tool.get("name")
            log.info("tool %s of type %s left out: edgespec calls function tools only", name, kind)
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        functions.append({"type": "function", "function": function})
    if not functions:
        return {}
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return {
        "tools": functions,
        "tool_choice": choice,
        "parallel_tool_calls": json_field(body, "parallel_tool_calls", (bool,), True),
    }


def _schema(body: dict) -> dict | None:
    """The JSON schema of text.format (json_schema or json_object), if any."""
    text = body.get("text") or {}
    form = text.get("format") if isinstance(text, dict) else None
    kind = form.get("type") if isinstance(form, dict) else "text"
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        if not isinstance(form.get("schema"), dict):
            raise RequestError("'text.format.schema' must be an object", "text.format")
        return form["schema"]
    if form is not None and kind != "text":
        raise RequestError("'text.format.type' must be text, json_object or json_schema", "text.format")
    return None


def usage(stats: Stats) -> dict:
    return {
        "input_tokens": stats.n_prompt,
        "input_tokens_details": {"cached_tokens": stats.n_prompt_cached},
        "output_tokens": stats.n_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.n_prompt + stats.n_tokens,
    }


class Responses(Dialect):
    def __init__(self, model: str) -> None:
        self.model = model
        self.stored: OrderedDict[str, list[dict]] = OrderedDict()  # response id -> its conversation

    def job(self, body: dict) -> ResponsesJob:
        try:
            previous = body.get("previous_response_id")
            if previous is not None and previous not in self.stored:
                raise RequestError(
                    f"previous_response_id '{previous}' is not known here: the server keeps its last {MAX_STORED}"
                    " stored responses in memory until it stops; send the whole conversation as input instead",
                    "previous_response_id",
                )
            history = messages_of(body, self.stored[previous] if previous else [])
            instructions = json_field(body, "instructions", (str,))
            messages = _leading_system([{"role": "system", "content": instructions}] * bool(instructions) + history)
            request = Request(
                messages,
                sampling_of(body),
                max_tokens=answer_limit(body, "max_output_tokens"),
                json_schema=_schema(body),
                **_tools(body),
                **own_fields(body),
            )
            stream = json_field(body, "stream", (bool,), False)
            store = json_field(body, "store", (bool,), True)
        except RequestError as e:
            raise refused(e) from None
        return ResponsesJob(request, stream, history=history, store=store)

    def _response(self, answer: Answer, output: list[dict], *, done: bool) -> dict:
        request, stats = answer.run.request, answer.stats
        incomplete = done and not answer.calls and stats.finish_reason in ("length", "context")
        status = "in_progress" if not done else "incomplete" if incomplete else "completed"
        sampling = request.sampling
        return {
            "id": f"resp_{answer.id}",
            "object": "response",
            "created_at": answer.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage(stats) if done else None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "instructions": None,
            "max_output_tokens": request.max_tokens,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": None,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "tool_choice": request.tool_choice.mode if request.tools else "none",
            "tools": [{"type": "function"} | t["function"] for t in request.tools or ()],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": {},
            "store": answer.job.store,
        } | ({"speculative": stats.as_dict()} if done else {})

    def _keep(self, answer: Answer, text: str) -> None:
        """A stored response's conversation, for previous_response_id."""
        if not answer.job.store:
            return
        message = {"role": "assistant", "content": text}
        if answer.calls:
            message["tool_calls"] = [c.as_openai() for c in answer.calls]
        self.stored[f"resp_{answer.id}"] = [*answer.job.history, message]
        while len(self.stored) > MAX_STORED:
            self.stored.popitem(last=False)

    async def whole(self, answer: Answer) -> dict:
        piece = await answer.whole()
        output = ([_message(answer, piece.text)] if piece.text else []) + [_function_call(c) for c in piece.calls]
        self._keep(answer, piece.text)
        return self._response(answer, output, done=True)

    async def chunks(self, answer: Answer) -> AsyncIterator[str]:
        """response.created, then per output item: added, its deltas, done; response.completed
        (or response.incomplete where the answer hit max_output_tokens)."""
        events = _Events()
        yield events.send("response.created", response=self._response(answer, [], done=False))
        yield events.send("response.in_progress", response=self._response(answer, [], done=False))
        output: list[dict] = []
        text: list[str] = []  # the open message's text

        def close_message():
            whole = "".join(text)
            item = _message(answer, whole, len(output))
            position = {"item_id": item["id"], "output_index": len(output), "content_index": 0}
            yield events.send("response.output_text.done", **position, text=whole)
            yield events.send("response.content_part.done", **position, part=item["content"][0])
            yield events.send("response.output_item.done", output_index=len(output), item=item)
            output.append(item)

        async for piece in answer.pieces():
            if piece.text:
                added = _message(answer, "", len(output)) | {"status": "in_progress", "content": []}
                position = {"item_id": added["id"], "output_index": len(output), "content_index": 0}
                if not text:
                    yield events.send("response.output_item.added", output_index=len(output), item=added)
                    part = {"type": "output_text", "text": "", "annotations": []}
                    yield events.send("response.content_part.added", **position, part=part)
                text.append(piece.text)
                yield events.send("response.output_text.delta", **position, delta=piece.text)
            for call in piece.calls:
                if text:
                    for event in close_message():
                        yield event
                item = _function_call(call)
                at = {"output_index": len(output)}
                opened = item | {"arguments": "", "status": "in_progress"}
                yield events.send("response.output_item.added", **at, item=opened)
                position = at | {"item_id": item["id"]}
                yield events.send("response.function_call_arguments.delta", **position, delta=call.arguments)
                yield events.send("response.function_call_arguments.done", **position, arguments=call.arguments)
                yield events.send("response.output_item.done", **at, item=item)
                output.append(item)
                text = []
        if text:
            for event in close_message():
                yield event
        self._keep(answer, "".join(m["content"][0]["text"] for m in output if m["type"] == "message"))
        final = self._response(answer, output, done=True)
        ending = "incomplete" if final["status"] == "incomplete" else "completed"
        yield events.send(f"response.{ending}", response=final)

    def stream_error(self, error: ApiError) -> str:
        failed = {"type": "error", "code": error.code or "server_error", "message": str(error), "param": error.param}
        return sse(failed, "error")


class _Events:
    """The stream's events, numbered (sequence_number) in the order sent."""

    def __init__(self) -> None:
        self.sequence = 0

    def send(self, kind: str, **fields) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence} | fields, kind)


def _message(answer: Answer, text: str, index: int = 0) -> dict:
    """The answer's text as a message item; index: its place in the output."""
    part = {"type": "output_text", "text": text, "annotations": []}
    message_id = f"msg_{answer.id}_{index}"
    return {"type": "message", "id": message_id, "status": "completed", "role": "assistant", "content": [part]}


def _function_call(call: ToolCall) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{call.id.removeprefix('call_')}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }
