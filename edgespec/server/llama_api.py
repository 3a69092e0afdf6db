"""llama-server's own completion API, what editors speak: POST /completion (Continue's and
Tabby's llama.cpp backends: the prompt as text, FIM markup in it) and POST /infill
(llama.vscode: the code before and after the cursor and snippets of other files, laid out
in the model's FIM tokens, see fim.py). The request is translated onto Request; the answer is
llama-server's: `content`, `stop_type`, `tokens_cached`, `truncated`, `timings`, and ours,
`speculative`; streamed as SSE `data: {"content": ..., "stop": false}` events ending with the
whole answer's object and `"stop": true`. n_cmpl > 1 answers in llama-server's array of such
objects, one per answer.

Sampling as llama-server's: `samplers` names the filters that run (others are off, and
without "temperature" the law is at temperature 1, as in llama.cpp's chain); "infill" is
llama.cpp's infill sampler (sampling.infill). The named filters run in llama.cpp's default
order whatever the order given; penalties, DRY, XTC, typical-p and top-n-sigma are accepted
and left out (their llama-server defaults switch them off). cache_prompt and
t_max_prompt_ms are accepted: a prompt is always read from the cache where it can be, and
llama-server does not time prompts either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.responses import JSONResponse

from ..fim import Chunk, Infill
from ..request import Request, RequestError
from ..sampling import SamplingParams
from ..stats import Stats
from .answers import MAX_ANSWERS, Answer, ApiError, Dialect, Job, Piece, refused, sse
from .api_body import completion_prompt, constraint_of, json_field, own_fields, sampling_of

# llama.cpp's sampler names (and their one-letter forms) -> the filter they switch on; None: accepted, left out
SAMPLERS = {
    "top_k": "top_k",
    "top_p": "top_p",
    "nucleus": "top_p",
    "min_p": "min_p",
    "temperature": "temperature",
    "temp": "temperature",
    "infill": "infill",
    **dict.fromkeys(("penalties", "dry", "xtc", "typ_p", "typical_p", "typ", "top_n_sigma", "adaptive_p")),
}
SAMPLER_CHARS = {"k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature", "i": "infill", **dict.fromkeys("edxys")}
STOP_TYPES = {
    "stop": "eos",
    "stop_string": "word",
    **dict.fromkeys(("length", "context", "indent", "deadline"), "limit"),
}


def request_of(body: dict, *, infill: bool) -> Request:
    """The Request of a /completion (infill=False) or /infill body; RequestError naming the
    first field that is wrong."""
    n_predict = json_field(body, "n_predict" if "n_predict" in body else "max_tokens", (int,), -1)
    if n_predict < -1:
        raise RequestError("'n_predict' must be -1 (no limit), 0 (read the prompt only) or more", "n_predict")
    indent = json_field(body, "n_indent", (int,), 0)
    if indent < 0:
        raise RequestError("'n_indent' must be >= 0", "n_indent")
    deadline_ms = json_field(body, "t_max_predict_ms", (int, float), 0)
    json_schema, grammar = constraint_of(body)
    sampling, sets_temperature = _sampling(body)
    fields = own_fields(body) | {"sets_temperature": sets_temperature}
    if fields["heal"] is None and json_schema is None and grammar is None:
        fields["heal"] = True  # an editor's text ends where the user is typing: mid-word, often
    return Request(
        _infill(body) if infill else completion_prompt(body),
        sampling,
        max_tokens=None if n_predict == -1 else n_predict,
        stop=body.get("stop") or (),
        min_indent=indent,
        line_deadline_s=deadline_ms / 1000 if deadline_ms > 0 else None,
        raw=not infill,
        grammar=grammar,
        json_schema=json_schema,
        **fields,
    )


def answers_of(body: dict) -> int:
    """n_cmpl (or n): how many answers, as llama-server checks it."""
    count = json_field(body, "n_cmpl" if "n_cmpl" in body else "n", (int,), 1)
    if not 1 <= count <= MAX_ANSWERS:
        # in llama-server's words, which llama.vscode recognises
        raise RequestError(
            f"Field 'n_cmpl': Value must be between 1 <= value <= {MAX_ANSWERS}, but got {count}", "n_cmpl"
        )
    return count


def _infill(body: dict) -> Infill:
    for field in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(field), str):
            raise RequestError(f"'{field}' is required: a string", field)
    cursor = body.get("prompt", "")
    if not isinstance(cursor, str):
        raise RequestError("'prompt' must be a string (the cursor line up to the cursor)", "prompt")
    extra = body.get("input_extra") or []
    if not isinstance(extra, list):
        raise RequestError('\'input_extra\' must be a list of {"filename": string, "text": string}', "input_extra")
    chunks = []
    for i, chunk in enumerate(extra):
        text, filename = (chunk.get(k) if isinstance(chunk, dict) else None for k in ("text", "filename"))
        if not isinstance(text, str) or not isinstance(filename or "", str):
            where = f"input_extra[{i}]"
            raise RequestError(f"{where} must be an object with a string 'text' (and 'filename')", where)
        chunks.append(Chunk(text, filename or Chunk.filename))
    return Infill(body["input_prefix"], body["input_suffix"], cursor, chunks)


def _sampling(body: dict) -> tuple[SamplingParams, bool]:
    """sampling_of the body, seed -1 meaning none, and `samplers` (names or letters) switching
    off what it does not name; and whether the body fixes the temperature (its own, or 1 where
    its samplers leave temperature out: then a server's default does not apply)."""
    body = body | {"seed": None} if body.get("seed") == -1 else body
    sampling, given = sampling_of(body), body.get("temperature") is not None
    samplers = body.get("samplers")
    if samplers is None:
        return sampling, given
    if isinstance(samplers, str):
        named = [SAMPLER_CHARS.get(c, c) for c in samplers]
        table = SAMPLER_CHARS.values()
    elif isinstance(samplers, list) and all(isinstance(s, str) for s in samplers):
        named = [SAMPLERS.get(s.lower().replace("-", "_"), s) for s in samplers]
        table = SAMPLERS.values()
    else:
        raise RequestError("'samplers' must be a list of sampler names or a string of their letters", "samplers")
    if unknown := [s for s in named if s is not None and s not in table]:
        raise RequestError(
            f"unknown sampler '{unknown[0]}'; use top_k, top_p, min_p, temperature or infill", "samplers"
        )
    on = set(named)
    chain = replace(
        sampling,
        top_k=sampling.top_k if "top_k" in on else 0,
        top_p=sampling.top_p if "top_p" in on else 1.0,
        min_p=sampling.min_p if "min_p" in on else 0.0,
        temperature=sampling.temperature if "temperature" in on else 1.0,
        infill="infill" in on,
    )
    return chain, given or "temperature" not in on


def timings(stats: Stats) -> dict:
    """llama-server's timings of one answer, and the drafts it verified."""
    read = stats.n_prompt - stats.n_prompt_cached
    prompt_ms, predicted_ms = stats.prefill_s * 1000, stats.decode_s * 1000
    return {
        "cache_n": stats.n_prompt_cached,
        "prompt_n": read,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / read if read else 0.0,
        "prompt_per_second": read / stats.prefill_s if stats.prefill_s > 0 else 0.0,
        "predicted_n": stats.n_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.n_tokens if stats.n_tokens else 0.0,
        "predicted_per_second": stats.tokens_per_s,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
    }


class LlamaServer(Dialect):
    """infill=True: /infill; False: /completion."""

    def __init__(self, model: str, n_ctx: int, *, infill: bool) -> None:
        self.model, self.n_ctx, self.infill = model, n_ctx, infill

    def job(self, body: dict) -> Job:
        try:
            request = request_of(body, infill=self.infill)
            return Job(request, json_field(body, "stream", (bool,), False), count=answers_of(body))
        except RequestError as e:
            raise refused(e) from None

    async def whole(self, answer: Answer) -> dict | list[dict]:
        """One answer's object; an array of them for several (n_cmpl)."""
        results = []
        while answer is not None:
            piece = await answer.whole()
            results.append(self._result(answer, piece.text, has_new_line="\n" in piece.text))
            answer = await answer.following()
        return results[0] if len(results) == 1 else results

    async def chunks(self, answer: Answer) -> AsyncIterator[str]:
        """Each answer's text as it comes, then its whole object (content empty, stop true)."""
        while answer is not None:
            new_line = False
            async for piece in answer.pieces():
                new_line |= "\n" in piece.text
                if piece.text:
                    yield sse(self._partial(answer, piece))
            yield sse(self._result(answer, "", has_new_line=new_line))
            answer = await answer.following()

    def _partial(self, answer: Answer, piece: Piece) -> dict:
        stats = piece.stats
        return {
            "index": answer.index,
            "content": piece.text,
            "tokens": [],
            "stop": False,
            "id_slot": 0,
            "tokens_predicted": stats.n_tokens,
            "tokens_evaluated": stats.n_prompt,
        }

    def _result(self, answer: Answer, content: str, *, has_new_line: bool) -> dict:
        stats, request = answer.stats, answer.run.request
        sampling = request.sampling
        settings = {
            "n_ctx": self.n_ctx,  # llama.vscode shows it
            "n_predict": -1 if request.max_tokens is None else request.max_tokens,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": sampling.min_p,
            "seed": -1 if sampling.seed is None else sampling.seed,
            "stop": list(request.stop),
            "n_indent": request.min_indent,
            "stream": answer.job.stream,
        }
        return {
            "index": answer.index,
            "content": content,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": stats.n_tokens,
            "tokens_evaluated": stats.n_prompt,
            "generation_settings": settings,
            "has_new_line": has_new_line,
            "truncated": stats.finish_reason == "context",
            "stop_type": STOP_TYPES.get(stats.finish_reason, "none"),
            "stopping_word": stats.stop_string or "",
            "tokens_cached": stats.n_prompt + stats.n_tokens,
            "timings": timings(stats),
            "speculative": stats.as_dict(),
        }

    def error(self, error: ApiError) -> JSONResponse:
        return JSONResponse({"error": _error(error)}, status_code=error.status)

    def stream_error(self, error: ApiError) -> str:
        return sse({"error": _error(error)})


def _error(error: ApiError) -> dict:
    """llama-server's error object (its `code` is the HTTP status)."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"code": error.status, "message": str(error), "type": kind, "param": error.param}
