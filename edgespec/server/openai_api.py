"""OpenAI's chat completions and completions (/v1/chat/completions, /v1/completions): the
request body as a Request (request_of), the answer a chat.completion(.chunk) or text_completion."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from ..fim import Infill
from ..logprobs import TokenLogprob, top_count
from ..request import Request, RequestError, checked
from ..stats import Stats
from ..tools import ToolCall
from .answers import MAX_ANSWERS, Answer, Dialect, Job, refused, sse
from .api_body import answer_limit, completion_prompt, constraint_of, json_field, own_fields, sampling_of, text_of

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
    if body.get("functions"):
        raise RequestError("'functions' is not supported by edgespec; send them as 'tools'", "functions")
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
    logprobs = _logprobs_of(body, chat)
    echo = not chat and json_field(body, "echo", (bool,), False)
    if echo and isinstance(prompt, Infill):
        raise RequestError("'echo' cannot be given with a 'suffix'", "echo")
    return Request(
        prompt,
        sampling_of(body),
        max_tokens=answer_limit(body, "max_completion_tokens", "max_tokens", least=0 if echo else 1),
        stop=body.get("stop") or (),
        raw=not chat,
        prediction=prediction,
        grammar=grammar,
        json_schema=json_schema,
        logprobs=logprobs,
        prompt_logprobs=echo and logprobs is not None,
        **calls,
        **own_fields(body),
    )


def _logprobs_of(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the body asks log-probabilities with (None: none): chat's
    `logprobs` (true) and `top_logprobs`, completions' `logprobs` (a count)."""
    if not chat:
        return checked(top_count, json_field(body, "logprobs", (int,)), param="logprobs")
    top = checked(top_count, json_field(body, "top_logprobs", (int,)), "top_logprobs", param="top_logprobs")
    if not json_field(body, "logprobs", (bool,), False):
        if top is not None:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def answers_of(body: dict, *, chat: bool, stream: bool) -> tuple[int, int]:
    """(answers to make, answers to return): `n`, and completions' `best_of` (made, the n of the
    highest log-probability per token returned)."""
    n = json_field(body, "n", (int,), 1)
    if not 1 <= n <= MAX_ANSWERS:
        raise RequestError(f"'n' must be 1..{MAX_ANSWERS}, got {n}", "n")
    best_of = n if chat else json_field(body, "best_of", (int,), n)
    if not n <= best_of <= MAX_ANSWERS:
        raise RequestError(f"'best_of' must be n..{MAX_ANSWERS} (n is {n}), got {best_of}", "best_of")
    if stream and best_of > n:
        raise RequestError("'best_of' above 'n' cannot be streamed: the best are known at the end", "best_of")
    return best_of, n


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
            count, returned = answers_of(body, chat=self.chat, stream=stream)
        except RequestError as e:
            raise refused(e) from None
        ranked = count > returned and request.logprobs is None  # best_of needs them, the client did not ask
        if ranked:
            request = replace(request, logprobs=0)
        echo = not self.chat and bool(body.get("echo"))
        return Job(
            request,
            stream,
            include_usage,
            count=count,
            returned=returned if count > returned else None,
            scored_only_to_rank=ranked,
            echo=echo,
        )

    async def whole(self, answer: Answer) -> dict:
        """Every answer (n, best_of) as a choice of one body; usage counts them all."""
        first, made = answer, []
        while answer is not None:
            made.append((answer, await answer.whole()))
            answer = await answer.following()
        answers = made
        if (returned := first.job.returned) is not None:  # best_of: the highest log-probability per token
            answers = sorted(made, key=lambda a: -mean_logprob(a[1].logprobs))[:returned]
        choices = []
        for index, (answer, piece) in enumerate(answers):
            scored = _Scored(first, answer)
            finish = self._finish_reason(answer)
            choices.append(self._choice(scored, piece.text, finish, piece.logprobs, delta=False, calls=piece.calls))
            choices[-1]["index"] = index
        return self._envelope(first, self.kind, choices) | self._closing([a for a, _ in made])

    async def chunks(self, answer: Answer) -> AsyncIterator[str]:
        """Each answer's text as it comes (under its choice's index), its finish reason, then the
        usage chunk if asked for, and [DONE]."""
        kind = f"{self.kind}.chunk" if self.chat else self.kind
        first, answers = answer, []
        while answer is not None:
            scored, opening = _Scored(first, answer), True
            async for piece in answer.pieces():
                if piece.text or piece.calls or piece.logprobs or opening:
                    delta = self._choice(
                        scored, piece.text, None, piece.logprobs, delta=True, first=opening, calls=piece.calls
                    )
                    yield sse(self._envelope(first, kind, [delta]))
                    opening = False
            finish = self._choice(scored, "", self._finish_reason(answer), [], delta=True)
            yield sse(self._envelope(first, kind, [finish]))
            answers.append(answer)
            answer = await answer.following()
        closing = self._closing(answers)
        yield sse(self._envelope(first, kind, []) | (closing if first.job.include_usage else _speculative(closing)))
        yield "data: [DONE]\n\n"

    def _finish_reason(self, answer: Answer) -> str | None:
        return "tool_calls" if answer.calls else FINISH_REASONS.get(answer.stats.finish_reason)

    def _envelope(self, answer: Answer, kind: str, choices: list) -> dict:
        answer_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{answer.id}"
        return {"id": answer_id, "object": kind, "created": answer.created, "model": self.model, "choices": choices}

    def _choice(
        self,
        scored: _Scored,
        text: str,
        finish: str | None,
        logprobs: list[TokenLogprob],
        *,
        delta: bool,
        first: bool = False,
        calls: list[ToolCall] = (),
    ) -> dict:
        answer = scored.answer
        if not self.chat:
            text, logprobs = scored.completion(text, logprobs, opening=first or not delta)
            return {"index": answer.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        shown = scored.shown and (logprobs or not delta)
        scores = {"logprobs": {"content": [_chat_logprob(t) for t in logprobs], "refusal": None}} if shown else {}
        if not delta:
            message = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
            return {"index": answer.index, "message": message, "finish_reason": finish, "logprobs": None} | scores
        out = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        if calls:  # each call whole, in one delta (clients join the pieces of a call by its index)
            out["tool_calls"] = [{"index": answer.calls.index(c)} | c.as_openai() for c in calls]
        return {"index": answer.index, "delta": out, "finish_reason": finish} | scores

    def _closing(self, answers: list[Answer]) -> dict:
        """usage (the prompt once, every answer's tokens) and the `speculative` statistics (of all answers)."""
        predicted = answers[0].job.request.prediction is not None
        stats = answers[0].stats
        if len(answers) > 1:
            stats = Stats.combine([a.stats for a in answers])
            stats.n_prompt, stats.n_prompt_cached = answers[0].stats.n_prompt, answers[0].stats.n_prompt_cached
        return {"usage": usage(stats, predicted), "speculative": stats.as_dict()}


def _speculative(closing: dict) -> dict:
    return {"speculative": closing["speculative"]}


class _Scored:
    """One answer's log-probabilities in the shapes of completions (and its echoed prompt),
    with the text offsets so far (a stream's chunks continue them)."""

    def __init__(self, first: Answer, answer: Answer) -> None:
        self.first, self.answer = first, answer
        job = answer.job
        self.shown = job.request.logprobs is not None and not job.scored_only_to_rank
        prompt = job.request.prompt
        self.offset = 0 if job.echo or not isinstance(prompt, str) else len(prompt)  # as llama-cpp-python counts

    def completion(self, text: str, logprobs: list[TokenLogprob], *, opening: bool) -> tuple[str, dict | None]:
        """The choice's text (the prompt first, where echoed) and its `logprobs` object."""
        if opening and self.answer.job.echo:
            text = self.answer.job.request.prompt + text
            logprobs = self.first.run.prompt_logprobs + logprobs  # (the prompt is scored once, by the first answer)
        if not self.shown:
            return text, None
        offsets = []
        for t in logprobs:
            offsets.append(self.offset)
            self.offset += len(t.text)
        return text, {
            "tokens": [t.text for t in logprobs],
            "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": [{a.text: a.logprob for a in t.top} if t.logprob is not None else None for t in logprobs],
            "text_offset": offsets,
        }


def _chat_logprob(t: TokenLogprob) -> dict:
    """A token's entry in chat's logprobs.content (its alternatives' without their own)."""
    entry = {"token": t.text, "logprob": t.logprob, "bytes": list(t.piece)}
    return entry | {"top_logprobs": [{"token": a.text, "logprob": a.logprob, "bytes": list(a.piece)} for a in t.top]}


def mean_logprob(logprobs: list[TokenLogprob]) -> float:
    """The log-probability per token of an answer (best_of's measure; an empty answer's is 0)."""
    return sum(t.logprob for t in logprobs) / len(logprobs) if logprobs else 0.0
