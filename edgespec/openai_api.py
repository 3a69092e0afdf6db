"""OpenAI's chat completions and completions (/v1/chat/completions, /v1/completions): the
request body as a Request (request_of), the answer a chat.completion(.chunk) or text_completion."""

from __future__ import annotations

from collections.abc import AsyncIterator

from .answers import Answer, Dialect, Job, refused, sse
from .api_body import answer_limit, completion_prompt, constraint_of, json_field, sampling_of, speculation_of, text_of
from .fim import Infill
from .request import Request, RequestError
from .stats import Stats
from .tools import ToolCall

FINISH_REASONS = {
    "stop": "stop",
    "stop_string": "stop",
    "indent": "stop",
    "deadline": "stop",
    "length": "length",
    "context": "length",
}


def request_of(body: dict, *, chat: bool) -> Request:
    """The request in an OpenAI request body (/v1/chat/completions, or /v1/completions with
    chat=False, where a `suffix` makes it a fill-in-the-middle), with llama-server's extensions
    (top_k, min_p, grammar, json_schema) and ours (draft_mode, gamma); RequestError naming the
    first field that is wrong."""
    prompt = _chat_messages(body) if chat else completion_prompt(body)
    if not chat and (suffix := json_field(body, "suffix", (str,))):  # Tabby's fill-in-the-middle
        prompt = Infill.at_cursor(prompt, suffix)
    if json_field(body, "n", (int,), 1) != 1:
        raise RequestError("only n=1 is supported: one answer per request", "n")
    for unsupported in ("logprobs", "functions", "echo"):
        if body.get(unsupported) not in (None, False, [], 0, ""):
            raise RequestError(f"'{unsupported}' is not supported by edgespec", unsupported)
    calls = {}
    if body.get("tools"):
        calls = {"tools": body["tools"], "tool_choice": body.get("tool_choice")}
        calls["parallel_tool_calls"] = json_field(body, "parallel_tool_calls", (bool,), True)
    prediction = body.get("prediction")
    if prediction is not None:
        if not isinstance(prediction, dict) or prediction.get("type") != "content":
            raise RequestError('\'prediction\' must be {"type": "content", "content": ...}', "prediction")
        prediction = text_of(prediction.get("content"), "prediction.content")
    json_schema, grammar = constraint_of(body)
    return Request(
        prompt,
        sampling_of(body),
        max_tokens=answer_limit(body, "max_completion_tokens", "max_tokens"),
        stop=body.get("stop") or (),
        raw=not chat,
        prediction=prediction,
        grammar=grammar,
        json_schema=json_schema,
        **calls,
        **speculation_of(body),
    )


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        message = {"role": m["role"], "content": text_of(m.get("content"), f"messages[{i}].content")}
        if m.get("tool_calls"):  # an assistant's earlier calls
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise RequestError(f"messages[{i}].tool_calls must be a list of calls", f"messages[{i}].tool_calls")
            message["tool_calls"] = calls
        if isinstance(m.get("tool_call_id"), str):  # a tool's result
            message["tool_call_id"] = m["tool_call_id"]
        chat.append(message)
    return chat


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


class OpenAIChat(Dialect):
    """chat=True: chat completions; False: completions (a prompt, raw text)."""

    def __init__(self, model: str, *, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.kind = "chat.completion" if chat else "text_completion"

    def job(self, body: dict) -> Job:
        try:
            request = request_of(body, chat=self.chat)
            stream = json_field(body, "stream", (bool,), False)
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise RequestError("'stream_options' must be an object", "stream_options")
            include_usage = json_field(options, "include_usage", (bool,), False)
        except RequestError as e:
            raise refused(e) from None
        return Job(request, stream, include_usage)

    async def whole(self, answer: Answer) -> dict:
        piece = await answer.whole()
        choice = self._choice(piece.text, self._finish_reason(answer), delta=False, calls=piece.calls)
        return self._envelope(answer, self.kind, [choice]) | self._closing(answer)

    async def chunks(self, answer: Answer) -> AsyncIterator[str]:
        """Text as it comes, the finish reason, the usage chunk if asked for, and [DONE]."""
        kind = f"{self.kind}.chunk" if self.chat else self.kind
        opening = True
        async for piece in answer.pieces():
            if piece.text or piece.calls or opening:
                delta = self._choice(piece.text, None, delta=True, first=opening, calls=piece.calls, answer=answer)
                yield sse(self._envelope(answer, kind, [delta]))
                opening = False
        yield sse(self._envelope(answer, kind, [self._choice("", self._finish_reason(answer), delta=True)]))
        closing = self._closing(answer) if answer.job.include_usage else {"speculative": answer.stats.as_dict()}
        yield sse(self._envelope(answer, kind, []) | closing)
        yield "data: [DONE]\n\n"

    def _finish_reason(self, answer: Answer) -> str | None:
        return "tool_calls" if answer.calls else FINISH_REASONS.get(answer.stats.finish_reason)

    def _envelope(self, answer: Answer, kind: str, choices: list) -> dict:
        answer_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{answer.id}"
        return {"id": answer_id, "object": kind, "created": answer.created, "model": self.model, "choices": choices}

    def _choice(
        self,
        text: str,
        finish: str | None,
        *,
        delta: bool,
        first: bool = False,
        calls: list[ToolCall] = (),
        answer: Answer | None = None,
    ) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if not delta:
            message = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
            return {"index": 0, "message": message, "finish_reason": finish}
        out = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        if calls:  # each call whole, in one delta (clients join the pieces of a call by its index)
            out["tool_calls"] = [{"index": answer.calls.index(c)} | c.as_openai() for c in calls]
        return {"index": 0, "delta": out, "finish_reason": finish}

    def _closing(self, answer: Answer) -> dict:
        predicted = answer.job.request.prediction is not None
        return {"usage": usage(answer.stats, predicted), "speculative": answer.stats.as_dict()}
