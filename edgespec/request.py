"""One request to the engine, from every shell: the command line, the chat app, bench and
the server (Request.from_openai, and the Messages and Responses APIs' translations in
anthropic_api.py and responses_api.py) build a Request, and Engine.stream takes it.

A Request is checked once, when it is made: a bad setting is one EdgespecError naming
it (RequestError, with the API field it came from). What needs the model (the chat
template, the prompt's length, compiling a grammar) is checked when the engine starts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from . import tools
from .chat import Message
from .errors import EdgespecError
from .fim import Infill
from .modes import AUTO, DraftMode, check_gamma, draft_mode
from .sampling import DEFAULT as DEFAULT_SAMPLING
from .sampling import SamplingParams

Prompt = str | Sequence[Message] | Infill
MAX_STOP = 16  # stop strings per request


class RequestError(EdgespecError):
    """A request that cannot be served; `param` names the API field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Request:
    """What to answer and how.

    prompt: a user message (str) or a conversation of {"role", "content"} messages, rendered
    with the model's chat template; raw=True sends a str as plain completion text
    (special-token markup such as <|im_start|> parsed); an Infill is a fill-in-the-middle
    completion (an editor's: code before and after the cursor), laid out in the model's FIM
    tokens (fim.py), the answer being the middle.
    max_tokens: the answer's length at most (0: the prompt is only read into the cache);
    None: until the model stops or the context is full (finish_reason "context").
    stop: strings that end the answer (trimmed from it). An editor's stops: min_indent, a
    line after the first indented by fewer spaces or tabs ends the answer before it
    (finish_reason "indent"); line_deadline_s, once the answer took this long it ends at its
    next newline (finish_reason "deadline").
    draft_mode: auto, model, copy, hybrid or off (the target alone, the baseline); gamma: draft
    tokens per round, or "auto"; None for either: the engine's default.
    prediction: text the answer will largely repeat (OpenAI's Predicted Outputs, e.g. the file
    being edited): drafts are copied from it; the output is the same with or without it.
    tools: OpenAI's function tools, rendered through the chat template (see tools.py);
    tool_choice: OpenAI's (auto, none, required or a named function) or a ToolChoice.
    "required" and a function start the answer with the call's opening and constrain the
    rest to the calls allowed (tools.call_grammar); the events do not repeat the opening:
    read them with request.call_parser(), or use Engine.generate, which returns the calls
    parsed (in auto mode also those a small model writes as a fenced JSON object or the like:
    tools.read_loose_call). A named function, or parallel_tool_calls=False, ends the answer
    with the (first) call.
    grammar: GBNF text (root rule `root`) the answer must match; json_schema: a JSON schema
    (dict or JSON text) the answer must be an instance of, written on one line in
    json.dumps's style ({"type": "object"}: any JSON object). The answer is drawn from the
    target's law masked by the grammar, exactly, with or without speculation; text the
    grammar forces (keys, punctuation) is drafted for free (see grammar.py)."""

    prompt: Prompt
    sampling: SamplingParams = DEFAULT_SAMPLING
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    min_indent: int = 0
    line_deadline_s: float | None = None
    raw: bool = False
    draft_mode: DraftMode | None = None
    gamma: int | str | None = None
    prediction: str | None = None
    grammar: str | None = None
    json_schema: dict | str | None = None
    tools: Sequence[dict] | None = None
    tool_choice: tools.ToolChoice | str | dict | None = None
    parallel_tool_calls: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)  # frozen: the checked values are set once, here
        if not isinstance(self.prompt, (str, Infill)):
            if self.raw:
                raise RequestError("a raw prompt must be a string, not a list of messages", "prompt")
            set_("prompt", tuple(self.prompt))
        tokens = self.max_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
            raise RequestError(f"max-tokens must be >= 0, got {self.max_tokens}", "max_tokens")
        if isinstance(self.min_indent, bool) or not isinstance(self.min_indent, int) or self.min_indent < 0:
            raise RequestError(f"the minimum indentation must be an integer >= 0, got {self.min_indent!r}", "n_indent")
        deadline = self.line_deadline_s
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline < 0
        ):
            raise RequestError(
                f"the line deadline must be a number of seconds >= 0, got {deadline!r}", "t_max_predict_ms"
            )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) for s in stop):
            raise RequestError("'stop' must be a string or a list of strings", "stop")
        if len(stop) > MAX_STOP:
            raise RequestError(f"at most {MAX_STOP} stop strings", "stop")
        if self.draft_mode is not None:
            set_("draft_mode", _field(draft_mode, self.draft_mode, param="draft_mode"))
        set_("gamma", _field(check_gamma, self.gamma, param="gamma"))
        choice = _field(tools.tool_choice_of, self.tools, self.tool_choice, param="tools")
        if self.tools is not None:
            set_("tools", tuple(self.tools))
        set_("tool_choice", choice)
        set_("stop", stop)
        if self.grammar is not None and self.json_schema is not None:
            raise RequestError("give a grammar or a JSON schema, not both", "grammar")
        constrained = self.grammar is not None or self.json_schema is not None
        if self.calls_tools and choice.call_schema is not None and constrained:
            raise RequestError("a forced tool call cannot also follow a grammar or schema; give one of them", "tools")
        if self.calls_tools and isinstance(self.prompt, Infill):
            raise RequestError("a fill-in-the-middle prompt cannot call tools; send a chat prompt", "tools")

    @classmethod
    def of(
        cls,
        prompt: Prompt,
        *,
        max_tokens: int | None = None,
        gamma: int | str | None = None,
        draft_mode: str | None = None,
        speculative: bool = True,
        stop: Sequence[str] = (),
        raw: bool = False,
        prediction: str | None = None,
        temperature: float = DEFAULT_SAMPLING.temperature,
        top_k: int = DEFAULT_SAMPLING.top_k,
        top_p: float = DEFAULT_SAMPLING.top_p,
        min_p: float = DEFAULT_SAMPLING.min_p,
        seed: int | None = None,
        tools: Sequence[dict] | None = None,
        tool_choice: tools.ToolChoice | str | dict | None = None,
        parallel_tool_calls: bool = True,
        grammar: str | None = None,
        json_schema: dict | str | None = None,
    ) -> Request:
        """A request from keywords (what Engine.stream and generate take besides a Request):
        the sampling settings one by one, and speculative=False for draft_mode "off"."""
        return cls(
            prompt,
            SamplingParams(temperature, top_k, top_p, min_p, seed),
            max_tokens=max_tokens,
            stop=stop,
            raw=raw,
            draft_mode=DraftMode.OFF if not speculative else draft_mode,
            gamma=gamma,
            prediction=prediction,
            grammar=grammar,
            json_schema=json_schema,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
        )

    def settled(self, draft_mode: DraftMode, gamma: int | str | None) -> Request:
        """This request with the engine's defaults for what it leaves unset."""
        return replace(self, draft_mode=self.draft_mode or draft_mode, gamma=self.gamma or gamma or AUTO)

    @property
    def fixed_gamma(self) -> int | None:
        """The draft length asked for, or None where it is chosen per round."""
        return None if self.gamma in (None, AUTO) else self.gamma

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may call tools."""
        return bool(self.tools) and self.tool_choice.mode != "none"

    def call_parser(self) -> tools.ToolCallParser | None:
        """What reads the answer's tool calls apart from its text (None where it calls none)."""
        if not self.calls_tools:
            return None
        names = [t["function"]["name"] for t in self.tools]
        return tools.ToolCallParser(self.tool_choice.opening, parallel=self.parallel_tool_calls, names=names)

    @property
    def stops(self) -> tuple[str, ...]:
        """The strings that end the answer: the request's, and the end of a call where the
        answer ends with its call (a named function, or one call only)."""
        ends_with_call = self.calls_tools and (self.tool_choice.one_call or not self.parallel_tool_calls)
        return (*self.stop, tools.CLOSE) if ends_with_call else self.stop

    # --- OpenAI's chat completions and completions -------------------------------
    @classmethod
    def from_openai(cls, body: dict, *, chat: bool) -> Request:
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
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, (str, list)):
            raise RequestError("'stop' must be a string or a list of strings", "stop")
        calls = {}
        if body.get("tools"):
            calls = {"tools": body["tools"], "tool_choice": body.get("tool_choice")}
            calls["parallel_tool_calls"] = json_field(body, "parallel_tool_calls", (bool,), True)
        prediction = body.get("prediction")
        if prediction is not None:
            if not isinstance(prediction, dict) or prediction.get("type") != "content":
                raise RequestError('\'prediction\' must be {"type": "content", "content": ...}', "prediction")
            prediction = _text(prediction.get("content"), "prediction.content")
        json_schema, grammar = constraint_of(body)
        return cls(
            prompt,
            sampling_of(body),
            max_tokens=answer_limit(body, "max_completion_tokens", "max_tokens"),
            stop=stop or (),
            raw=not chat,
            prediction=prediction,
            grammar=grammar,
            json_schema=json_schema,
            **calls,
            **speculation_of(body),
        )


def sampling_of(body: dict) -> SamplingParams:
    """The sampling settings of an API request body (temperature, top_p, and llama-server's
    top_k, min_p and seed, by the names every API here uses); the defaults for those unset."""
    sampling = {name: json_field(body, name, (int, float)) for name in ("temperature", "top_p", "min_p")}
    sampling |= {"top_k": json_field(body, "top_k", (int,)), "seed": json_field(body, "seed", (int,))}
    return _field(lambda: replace(DEFAULT_SAMPLING, **{k: v for k, v in sampling.items() if v is not None}))


def speculation_of(body: dict) -> dict:
    """edgespec's own fields of an API request body, as Request's keywords: draft_mode and gamma."""
    gamma = body.get("gamma")
    if gamma is not None and gamma != AUTO and (isinstance(gamma, bool) or not isinstance(gamma, int)):
        raise RequestError("'gamma' must be an integer or \"auto\"", "gamma")
    return {"draft_mode": json_field(body, "draft_mode", (str,)), "gamma": gamma}


def _field(check, *args, param: str | None = None):
    """check(*args), its EdgespecError as a RequestError naming `param`."""
    try:
        return check(*args)
    except RequestError:
        raise
    except EdgespecError as e:
        raise RequestError(str(e), param) from None


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
    raise RequestError(f"'{param}' must be a string or a list of text parts", param)


def answer_limit(body: dict, *names: str) -> int | None:
    """The first of the fields `names` that is set: an answer's length at most, 1 or more (as
    OpenAI's and Anthropic's APIs take it; a Request's 0, the prompt only, is llama-server's)."""
    for name in names:
        if (value := json_field(body, name, (int,))) is not None:
            if value < 1:
                raise RequestError(f"'{name}' must be >= 1", name)
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


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        message = {"role": m["role"], "content": _text(m.get("content"), f"messages[{i}].content")}
        if m.get("tool_calls"):  # an assistant's earlier calls
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise RequestError(f"messages[{i}].tool_calls must be a list of calls", f"messages[{i}].tool_calls")
            message["tool_calls"] = calls
        if isinstance(m.get("tool_call_id"), str):  # a tool's result
            message["tool_call_id"] = m["tool_call_id"]
        chat.append(message)
    return chat


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
