"""The fields of an API request body that several APIs share, read one way for all of them
(OpenAI's, Anthropic's Messages, OpenAI's Responses, llama-server's): each is checked here,
or by Request itself, and a bad one is a RequestError naming it."""

from __future__ import annotations

import math
from dataclasses import replace

from ..request import RequestError, checked
from ..sampling import DEFAULT as DEFAULT_SAMPLING
from ..sampling import NO_PENALTIES, Penalties, SamplingParams

# llama.cpp's samplers edgespec does not run: refused where a body switches one on (the value that leaves it off)
UNSUPPORTED_SAMPLERS = {
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "mirostat": 0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "top_n_sigma": -1.0,
}
WHOLE_ANSWER = 1 << 30  # repeat_last_n -1 (llama-server: the whole context): every token of the answer


def sampling_of(body: dict) -> SamplingParams:
    """The sampling settings of an API request body (temperature, top_p, and llama-server's
    top_k, min_p and seed, by the names every API here uses; OpenAI's presence and frequency
    penalties and logit_bias, llama-server's repeat_penalty and repeat_last_n); the defaults for
    those unset. A sampler edgespec does not run, switched on, is refused by name."""
    for name, off in UNSUPPORTED_SAMPLERS.items():
        if json_field(body, name, (int, float), off) != off:
            raise RequestError(f"'{name}' is not supported by edgespec; leave it out or set it to {off}", name)
    sampling = {name: json_field(body, name, (int, float)) for name in ("temperature", "top_p", "min_p")}
    sampling |= {"top_k": json_field(body, "top_k", (int,)), "seed": json_field(body, "seed", (int,))}
    given = {k: v for k, v in sampling.items() if v is not None} | {"penalties": _penalties(body)}
    return checked(lambda: replace(DEFAULT_SAMPLING, **given))


def _penalties(body: dict) -> Penalties:
    fields = {"presence_penalty": "presence", "frequency_penalty": "frequency", "repeat_penalty": "repeat"}
    given = {own: json_field(body, name, (int, float)) for name, own in fields.items()}
    last_n = json_field(body, "repeat_last_n", (int,))
    if last_n is not None and last_n < -1:
        raise RequestError("'repeat_last_n' must be -1 (the whole answer), 0 (none) or more tokens", "repeat_last_n")
    given["last_n"] = WHOLE_ANSWER if last_n == -1 else last_n
    given["bias"] = _logit_bias(body.get("logit_bias"))
    return checked(lambda: replace(NO_PENALTIES, **{k: v for k, v in given.items() if v is not None}))


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as OpenAI sends it ({"token id": bias}) or llama-server ([[id, bias], ...], a
    bias of false: never); token ids only."""
    if bias is None:
        return ()
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise RequestError("'logit_bias' must be {\"token id\": bias} or [[token id, bias], ...]", "logit_bias")
    out = []
    for token, value in pairs:
        if isinstance(token, str) and token.lstrip("-").isdigit():
            token = int(token)
        if not isinstance(token, int) or isinstance(token, bool):
            raise RequestError(f"logit_bias: {token!r} is not a token id (texts are not supported)", "logit_bias")
        if value is False:
            value = -math.inf
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise RequestError(f"logit_bias: the bias of token {token} must be a number (or false)", "logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def own_fields(body: dict) -> dict:
    """edgespec's own fields of an API request body, as Request's keywords (which checks them):
    draft_mode, gamma and heal (token healing, where the prompt is raw text or an infill); and
    whether it sets the temperature (else a server's default applies: Defaults.temperature)."""
    own = {"draft_mode": body.get("draft_mode"), "gamma": body.get("gamma"), "heal": json_field(body, "heal", (bool,))}
    return own | {"sets_temperature": body.get("temperature") is not None}


def text_of(content, param: str, parts: tuple[str, ...] = ("text",)) -> str:
    """A message's content: a string, or a list of text parts (objects of a type in `parts`,
    whose text is under "text", or "refusal" for a refusal)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if other := next((p.get("type") for p in content if p.get("type") not in parts), None):
            raise RequestError(f"'{param}': '{other}' parts are not supported; edgespec reads text only", param)
        texts = [p.get("text", p.get("refusal", "")) for p in content]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise RequestError(f"'{param}' must be a string or a list of text parts", param)


def answer_limit(body: dict, *names: str, least: int = 1) -> int | None:
    """The first of the fields `names` that is set: an answer's length at most, 1 or more (as
    OpenAI's and Anthropic's APIs take it; least=0 allows the prompt only, as llama-server's
    n_predict and a completion that echoes and scores its prompt do)."""
    for name in names:
        if (value := json_field(body, name, (int,))) is not None:
            if value < least:
                raise RequestError(f"'{name}' must be >= {least}", name)
            return value
    return None


def json_field(body: dict, name: str, kinds: tuple, default=None):
    """body[name] if it is of one of `kinds` (int, float, str, bool), `default` if unset, else RequestError."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(
            {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}[k] for k in kinds
        )
        raise RequestError(f"'{name}' must be {names}", name)
    return value


def completion_prompt(body: dict) -> str:
    """A completion body's `prompt`: one non-empty string (or a list of one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string", "prompt")
    return prompt


def constraint_of(body: dict) -> tuple[dict | None, str | None]:
    """(json_schema, grammar) the answer must match: OpenAI's response_format, or
    llama-server's `json_schema` (a schema) and `grammar` (GBNF text) fields, at most one of them."""
    response_format, json_schema = body.get("response_format"), body.get("json_schema")
    if json_schema is not None and not isinstance(json_schema, dict):
        raise RequestError("'json_schema' must be an object (a JSON schema)", "json_schema")
    grammar = json_field(body, "grammar", (str,))
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is not None and kind != "text":
        if json_schema is not None or grammar is not None:
            raise RequestError("give one of response_format, json_schema and grammar", "response_format")
        if kind == "json_object":
            json_schema = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise RequestError("'response_format.json_schema.schema' must be an object", "response_format")
            json_schema = spec["schema"]
        else:
            raise RequestError("'response_format.type' must be text, json_object or json_schema", "response_format")
    if json_schema is not None and grammar is not None:
        raise RequestError("give one of response_format, json_schema and grammar", "grammar")
    return json_schema, grammar
