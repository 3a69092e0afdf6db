"""One request to the engine, from every shell: the command line, the chat app, bench and
the server (each API's translation of its request body: server/openai_api.py,
anthropic_api.py, responses_api.py, llama_api.py) build a Request, and Engine.stream takes it.

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
from .logprobs import top_count
from .modes import DraftMode, Gamma, draft_mode
from .sampling import DEFAULT as DEFAULT_SAMPLING
from .sampling import NO_PENALTIES, Penalties, SamplingParams

Prompt = str | Sequence[Message] | Infill
MAX_STOP = 16  # stop strings per request


class RequestError(EdgespecError):
    """A request that cannot be served; `param` names the API field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Defaults:
    """What a request gets for a setting it leaves unset: the engine's draft mode and γ, and a
    server's cap on an answer's length and its temperature (None: no cap; the request's own
    temperature, llama.cpp's default where it set none)."""

    draft_mode: DraftMode = DraftMode.AUTO
    gamma: Gamma = Gamma()
    max_tokens: int | None = None
    temperature: float | None = None


@dataclass(frozen=True)
class Request:
    """What to answer and how.

    prompt: a user message (str) or a conversation of {"role", "content"} messages, rendered
    with the model's chat template; raw=True sends a str as plain completion text
    (special-token markup such as <|im_start|> parsed); an Infill is a fill-in-the-middle
    completion (an editor's: code before and after the cursor), laid out in the model's FIM
    tokens (fim.py), the answer being the middle.
    heal: token healing (healing.py) of a prompt that ends mid-word: its last tokens are taken
    back and the answer begins with their text, which it does not return again; None: heal an
    infill's middle (the text typed on the cursor line), not other prompts. For raw and infill
    prompts, without a grammar, schema or tools.
    max_tokens: the answer's length at most (0: the prompt is only read into the cache);
    None: until the model stops or the context is full (finish_reason "context").
    stop: strings that end the answer (trimmed from it). An editor's stops: min_indent, a
    line after the first indented by fewer spaces or tabs ends the answer before it
    (finish_reason "indent"); line_deadline_s, once the answer took this long it ends at its
    next newline (finish_reason "deadline").
    draft_mode: auto, model, copy, hybrid or off (the target alone, the baseline); gamma: draft
    tokens per round, or "auto" (a modes.Gamma once made); None for either: the engine's default.
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
    grammar forces (keys, punctuation) is drafted for free (see grammar.py).
    logprobs: each answer token's log-probability (Event.logprob, Generation.logprobs) with
    this many likeliest alternatives (0..20); None: none. They are the target's own
    log-softmax, before temperature and filters, whatever drafted the token or constrained
    the answer. prompt_logprobs: the same for the prompt's tokens after the first
    (Run.prompt_logprobs, Generation.prompt_logprobs; what OpenAI's `echo` scores); the
    prompt is then read whole, none of it from the cache.
    trees: whether a round may verify a tree of drafts (Controller) where the machine's costs
    say one pays; False: chains only (to compare them).
    memory: whether the engine's memory (memory.py) drafts for this request and keeps its prompt
    and answer when it ends; False: neither (the request leaves no trace there).
    sets_temperature: False where a client left the temperature unset (an API body without
    one), so that a server's default temperature (Defaults.temperature) is the one used.
    again: the prompt was answered just before (a request's answers after the first: OpenAI's n,
    llama-server's n_cmpl; a regenerated answer): where this answer goes the way the last one
    went, it is drawn from the rows that answer's passes computed, with no pass of its own
    (known_rows.py); the law is the same. Answers with a draft mode of off are not kept.
    streamed: the answer is shown as it comes (Engine.stream, a streamed API response), so
    its first token's wait counts: the first round is planned to end within about a plain
    step (Controller.plan), where a whole answer (generate(), an editor's suggestion) waits
    only for its last token and every round is planned for speed. The answer is the same."""

    prompt: Prompt
    sampling: SamplingParams = DEFAULT_SAMPLING
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    min_indent: int = 0
    line_deadline_s: float | None = None
    raw: bool = False
    draft_mode: DraftMode | None = None
    gamma: Gamma | int | str | None = None
    prediction: str | None = None
    grammar: str | None = None
    json_schema: dict | str | None = None
    tools: Sequence[dict] | None = None
    tool_choice: tools.ToolChoice | str | dict | None = None
    parallel_tool_calls: bool = True
    logprobs: int | None = None
    prompt_logprobs: bool = False
    heal: bool | None = None
    trees: bool = True
    memory: bool = True
    sets_temperature: bool = True
    streamed: bool = False
    again: bool = False

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
        checked(top_count, self.logprobs, param="logprobs")
        if self.draft_mode is not None:
            set_("draft_mode", checked(draft_mode, self.draft_mode, param="draft_mode"))
        if self.gamma is not None:
            set_("gamma", checked(Gamma.of, self.gamma, param="gamma"))
        choice = checked(tools.tool_choice_of, self.tools, self.tool_choice, param="tools")
        if self.tools is not None:
            set_("tools", tuple(self.tools))
        set_("tool_choice", choice)
        set_("stop", stop_strings(self.stop))
        if self.grammar is not None and self.json_schema is not None:
            raise RequestError("give a grammar or a JSON schema, not both", "grammar")
        constrained = self.grammar is not None or self.json_schema is not None
        if self.calls_tools and choice.call_schema is not None and constrained:
            raise RequestError("a forced tool call cannot also follow a grammar or schema; give one of them", "tools")
        if self.calls_tools and isinstance(self.prompt, Infill):
            raise RequestError("a fill-in-the-middle prompt cannot call tools; send a chat prompt", "tools")
        if not isinstance(self.memory, bool):
            raise RequestError(f"memory must be true or false, got {self.memory!r}", "memory")
        if self.heal is not None and not isinstance(self.heal, bool):
            raise RequestError(f"heal must be true or false, got {self.heal!r}", "heal")
        if self.heal and not (self.raw or isinstance(self.prompt, Infill)):
            raise RequestError("token healing is for raw and fill-in-the-middle prompts; send raw text", "heal")
        if self.heal and (constrained or self.calls_tools):
            raise RequestError("token healing cannot go with a grammar, a schema or tools; give one of them", "heal")

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
        penalties: Penalties = NO_PENALTIES,
        tools: Sequence[dict] | None = None,
        tool_choice: tools.ToolChoice | str | dict | None = None,
        parallel_tool_calls: bool = True,
        grammar: str | None = None,
        json_schema: dict | str | None = None,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        heal: bool | None = None,
        trees: bool = True,
        memory: bool = True,
        again: bool = False,
    ) -> Request:
        """A request from keywords (what Engine.stream and generate take besides a Request):
        the sampling settings one by one, and speculative=False for draft_mode "off"."""
        return cls(
            prompt,
            SamplingParams(temperature, top_k, top_p, min_p, seed, penalties=penalties),
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
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            heal=heal,
            trees=trees,
            memory=memory,
            again=again,
        )

    @property
    def healed(self) -> bool:
        """Whether the prompt's last word is healed (`heal`, or its default)."""
        if self.heal is not None:
            return self.heal
        constrained = self.grammar is not None or self.json_schema is not None
        return isinstance(self.prompt, Infill) and not constrained

    def answer(self, index: int, previous: str, elapsed_s: float = 0.0) -> Request:
        """The request of answer `index` of several to this prompt (OpenAI's n, llama-server's
        n_cmpl), `elapsed_s` after the first began: a seeded request's seed + index, and (where the
        request gives no prediction) the answer before as its predicted output, where they are made
        one after another (previous; "" side by side, see Engine.answers_together), and asked again
        (`again`: drawn from the rows of the answer before where it goes the same way). Answers to
        one prompt are much alike, so the next is drafted from the last where they agree; each is
        still drawn from the target's law (the same answer as a request of that seed alone). The answers
        share line_deadline_s, as llama-server's slots, which answer side by side, do."""
        if index == 0:
            return self
        sampling = self.sampling
        if sampling.seed is not None:
            sampling = replace(sampling, seed=sampling.seed + index)
        prediction = self.prediction or previous or None
        deadline = self.line_deadline_s
        if deadline is not None:
            deadline = max(0.0, deadline - elapsed_s)
        # (the prompt is scored once)
        return replace(
            self, sampling=sampling, prediction=prediction, line_deadline_s=deadline, prompt_logprobs=False, again=True
        )

    def settled(self, defaults: Defaults) -> Request:
        """This request with the engine's defaults (and a server's) for what it leaves unset."""
        sampling = self.sampling
        if not self.sets_temperature and defaults.temperature is not None:
            sampling = replace(sampling, temperature=defaults.temperature)
        return replace(
            self,
            sampling=sampling,
            max_tokens=self.max_tokens if self.max_tokens is not None else defaults.max_tokens,
            draft_mode=self.draft_mode or defaults.draft_mode,
            gamma=self.gamma or defaults.gamma,
        )

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


def stop_strings(stop, param: str = "stop") -> tuple[str, ...]:
    """Stop strings: one string or a list of at most MAX_STOP (RequestError naming `param` if not)."""
    stop = (stop,) if isinstance(stop, str) else stop or ()
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
        raise RequestError(f"'{param}' must be a string or a list of strings, at most {MAX_STOP} stop strings", param)
    return tuple(stop)


def checked(check, *args, param: str | None = None):
    """check(*args), its EdgespecError as a RequestError naming `param`."""
    try:
        return check(*args)
    except RequestError:
        raise
    except EdgespecError as e:
        raise RequestError(str(e), param) from None
