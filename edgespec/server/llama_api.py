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
order whatever the order given; penalties (repeat_penalty, repeat_last_n, presence_penalty,
frequency_penalty) run where the list names them, logit_bias always; DRY, XTC, typical-p and
top-n-sigma are accepted in the list and refused where a field switches them on. cache_prompt and
t_max_prompt_ms are accepted: a prompt is always read from the cache where it can be, and
llama-server does not time prompts either. n_probs: each token's log-probability and its
likeliest alternatives as llama-server's `completion_probabilities` (the model's own softmax,
before the samplers, as llama-server's without post_sampling_probs, which is refused).

llama-server's small endpoints beside them: POST /tokenize, /detokenize and /apply-template,
GET /props (tokenize_body, detokenize_body, props).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from importlib.metadata import version

import llama_cpp
from starlette.responses import JSONResponse

from ..engine import Engine
from ..fim import Chunk, Infill
from ..logprobs import TokenLogprob, top_count
from ..request import Request, RequestError, checked
from ..sampling import NO_PENALTIES, SamplingParams
from ..stats import Stats
from ..tokenizer import Tokenizer
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
    "penalties": "penalties",
    **dict.fromkeys(("dry", "xtc", "typ_p", "typical_p", "typ", "top_n_sigma", "adaptive_p")),
}
SAMPLER_CHARS = {
    "k": "top_k",
    "p": "top_p",
    "m": "min_p",
    "t": "temperature",
    "i": "infill",
    "e": "penalties",
    **dict.fromkeys("dxys"),
}
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
    fields = own_fields(body) | {"sets_temperature": sets_temperature, "logprobs": _n_probs(body)}
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


def _n_probs(body: dict) -> int | None:
    """n_probs: the alternatives shown per token (None: no probabilities)."""
    if json_field(body, "post_sampling_probs", (bool,), False):
        raise RequestError(
            "'post_sampling_probs' is not supported: n_probs gives the model's own log-probabilities,"
            " before the samplers; leave it out",
            "post_sampling_probs",
        )
    count = checked(top_count, json_field(body, "n_probs", (int,), 0), "n_probs", param="n_probs")
    return count or None


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
        # (logit_bias is no sampler of the list: llama-server applies it whatever the list says)
        penalties=sampling.penalties if "penalties" in on else replace(NO_PENALTIES, bias=sampling.penalties.bias),
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
            results.append(self._result(answer, piece.text, has_new_line="\n" in piece.text, logprobs=piece.logprobs))
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
        partial = {
            "index": answer.index,
            "content": piece.text,
            "tokens": [],
            "stop": False,
            "id_slot": 0,
            "tokens_predicted": stats.n_tokens,
            "tokens_evaluated": stats.n_prompt,
        }
        return partial | ({"completion_probabilities": probabilities(piece.logprobs)} if piece.logprobs else {})

    def _result(self, answer: Answer, content: str, *, has_new_line: bool, logprobs=()) -> dict:
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
        result = {
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
        return result | ({"completion_probabilities": probabilities(logprobs)} if logprobs else {})

    def error(self, error: ApiError) -> JSONResponse:
        return JSONResponse({"error": _error(error)}, status_code=error.status)

    def stream_error(self, error: ApiError) -> str:
        return sse({"error": _error(error)})


def tokenize_body(body: dict, vocab: Tokenizer) -> dict:
    """POST /tokenize: `content` (a string, or a list of strings and token ids) as tokens, with
    their pieces where `with_pieces` asks (the text, or its bytes where they are not whole UTF-8);
    add_special (false) adds BOS before the first string, parse_special (true) reads control
    tokens written in the text."""
    content = body.get("content", "")
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list) or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in parts):
        raise RequestError("'content' must be a string, or a list of strings and token ids", "content")
    add_special = json_field(body, "add_special", (bool,), False)
    parse_special = json_field(body, "parse_special", (bool,), True)
    tokens = []
    for i, part in enumerate(parts):
        if isinstance(part, int):
            tokens += _checked_tokens([part], vocab, "content")
        else:
            tokens += vocab.tokenize(part, add_special=add_special and i == 0, parse_special=parse_special)
    if not json_field(body, "with_pieces", (bool,), False):
        return {"tokens": tokens}
    return {"tokens": [{"id": t, "piece": _text_or_bytes(vocab.piece(t, special=True))} for t in tokens]}


def detokenize_body(body: dict, vocab: Tokenizer) -> dict:
    """POST /detokenize: `tokens` as text, control tokens written out (as llama-server does)."""
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError("'tokens' must be a list of token ids", "tokens")
    data = b"".join(vocab.piece(t, special=True) for t in _checked_tokens(tokens, vocab, "tokens"))
    return {"content": data.decode("utf-8", "replace")}


def _checked_tokens(tokens: list[int], vocab: Tokenizer, param: str) -> list[int]:
    """Token ids of this vocabulary (llama.cpp aborts on one outside it)."""
    if bad := next((t for t in tokens if not 0 <= t < vocab.n_vocab), None):
        raise RequestError(f"token id {bad} is not in the model's vocabulary (0..{vocab.n_vocab - 1})", param)
    return tokens


def _text_or_bytes(piece: bytes) -> str | list[int]:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def props(engine: Engine, model: str, metrics: bool) -> dict:
    """GET /props: llama-server's properties of what this server runs; the generation settings
    are those of a request that sets none (the server's temperature where it has one)."""
    target, sampling = engine.target, SamplingParams()
    temperature = engine.defaults.temperature if engine.defaults.temperature is not None else sampling.temperature
    limit = engine.defaults.max_tokens
    params = {
        "n_predict": -1 if limit is None else limit,
        "seed": -1,
        "temperature": temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "stop": [],
        "n_probs": 0,
        "samplers": ["top_k", "top_p", "min_p", "temperature"],
    }
    words = (target.token_text(t).decode("utf-8", "replace") for t in (target.bos, target.eos))
    return {
        "default_generation_settings": {"n_ctx": target.n_ctx, "params": params},
        "total_slots": engine.sequences.count,  # requests answered at once (serve --parallel)
        "model_alias": model,
        "model_path": str(target.path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": False,
        "endpoint_props": False,
        "endpoint_metrics": metrics,
        "chat_template": target.chat_template() or "",
        **dict(zip(("bos_token", "eos_token"), words, strict=True)),
        "build_info": f"edgespec {version('edgespec')}, llama-cpp-python {llama_cpp.__version__}",
        "is_sleeping": False,
    }


def probabilities(logprobs: list[TokenLogprob]) -> list[dict]:
    """llama-server's completion_probabilities: each token and its alternatives, likeliest first."""

    def entry(scored: TokenLogprob) -> dict:
        # (a token may end inside a UTF-8 character: its text is what decodes, its bytes are all)
        text = scored.piece.decode("utf-8", "ignore")
        return {"id": scored.token, "token": text, "bytes": list(scored.piece), "logprob": scored.logprob}

    return [entry(t) | {"top_logprobs": [entry(a) for a in t.top]} for t in logprobs]


def _error(error: ApiError) -> dict:
    """llama-server's error object (its `code` is the HTTP status)."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"code": error.status, "message": str(error), "type": kind, "param": error.param}
