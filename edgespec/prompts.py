"""A request made ready for a run: its prompt as the target's tokens (chat template and tools,
or a fill-in-the-middle layout), the grammar or healing constraint the answer obeys, and the
predicted text its copy drafter follows. One Prompts per engine, which keeps an editor's
keystrokes (keystrokes.py) from its first infill on."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .chat import PromptTooLong, render
from .errors import EdgespecError, PromptExceedsContext
from .fim import FimPrompt, Infill
from .grammar import Grammar, grammar_text
from .healing import Healing, heal, pieces_of
from .keystrokes import Keystrokes
from .model import Model
from .request import Request
from .sampling import Constraint
from .tools import call_grammar, prepare
from .vocabulary import FimTokens

MAX_CHARS_PER_TOKEN = 256  # longer than any token of the tokenizers we know (Qwen2.5's longest: 128 bytes)


@dataclass(frozen=True)
class Prepared:
    """What a Run needs of a request besides its settings."""

    tokens: list[int]  # the prompt, as the target reads it (less what healing took back)
    constraint: Constraint | None  # the grammar (or the healed text) the answer must follow
    healed: bytes  # the prompt's end taken back, which the answer writes again whole
    layout: FimPrompt | None  # a fill-in-the-middle prompt's layout
    prediction: list[int]  # the text the answer is expected to write (the copy drafter's), as tokens


class Prompts:
    """Turns the requests of one target into Prepared values."""

    def __init__(self, target: Model) -> None:
        self.target = target
        self.keystrokes: Keystrokes | None = None  # an editor's requests' memory, from the first infill on

    def prepare(self, request: Request, layout: FimPrompt | None = None) -> Prepared:
        """`request` (settled) made ready; layout: a fill-in-the-middle prompt as given (idle work
        reading a head)."""
        target = self.target
        if isinstance(request.prompt, Infill):
            layout = layout or self.layout(request.prompt)
            tokens, healable = self._fitting(layout.tokens), len(layout.head.tokens)
        else:
            tokens, healable = self.tokens(request), 0
        gbnf = grammar_text(request.grammar, request.json_schema)
        if request.calls_tools and request.tool_choice.call_schema is not None:  # a call is forced: its grammar
            gbnf = call_grammar(request.tool_choice, request.parallel_tool_calls)
        constraint = Grammar(target, gbnf) if gbnf is not None else None
        removed = b""
        if request.healed:  # the prompt's last word goes back: the answer writes it again, whole
            healed = heal(tokens, healable, pieces_of(target), target.piece)
            tokens, removed = tokens[: healed.kept], healed.removed
            constraint = Healing(pieces_of(target), removed, target.piece) if removed else None
        prediction = request.prediction
        if prediction is None and isinstance(request.prompt, Infill) and self.keystrokes is not None:
            prediction = self.keystrokes.prediction(request.prompt)  # where the user types what was suggested
        if prediction and removed:  # the answer's tokens write the healed text first
            prediction = removed.decode("utf-8", "ignore") + prediction
        prediction_tokens = target.text_tokens(prediction) if prediction else []
        return Prepared(tokens, constraint, removed, layout, prediction_tokens)

    def read_markup(self, request: Request) -> Request:
        """A raw prompt written in the target's FIM markup, [PRE]prefix[SUF]suffix[MID]begun
        (Continue's autocomplete on /completion), as the Infill it stands for: laid out as one
        (fim.py: the cursor line after [MID], healed, the head kept cached while the user types);
        other requests as they are. Repository-level markup (repository or file tokens), a prompt
        to be scored, a grammar's: left raw, as written."""
        fim, target = self.target.fim, self.target
        if not (request.raw and isinstance(request.prompt, str)) or fim.missing():
            return request
        if request.prompt_logprobs or request.grammar is not None or request.json_schema is not None:
            return request
        text = request.prompt
        pre, suf, mid = (target.token_text(t).decode("utf-8", "replace") for t in (fim.prefix, fim.suffix, fim.middle))
        others = [target.token_text(t).decode("utf-8", "replace") for t in (fim.repo, fim.file_sep) if t is not None]
        if not text.startswith(pre) or any(text.count(mark) != 1 for mark in (pre, suf, mid)):
            return request
        if any(other in text for other in others) or text.index(suf) > text.index(mid):
            return request
        prefix, rest = text[len(pre) :].split(suf)
        suffix, begun = rest.split(mid)
        return replace(request, prompt=Infill.at_cursor(prefix + begun, suffix), raw=False)

    def tokens(self, request: Request, fit: bool = True) -> list[int]:
        """The request's prompt as the target reads it: rendered with the chat template (and
        the tools), tokenized, and checked against the context (fit=False: counted whatever
        its length, up to what the tokenizer is given at all)."""
        request, target = self.read_markup(request), self.target
        if isinstance(request.prompt, Infill):
            return self._fitting(self.layout(request.prompt).tokens, fit)
        # a text this long cannot fit in the context whatever its tokens: refused before
        # llama.cpp's tokenizer spends seconds (and memory) on it
        max_chars = MAX_CHARS_PER_TOKEN * target.n_ctx
        tokens = target.tokenize(self._text(request, max_chars), add_special=True, parse_special=True)
        if len(tokens) > 1 and tokens[0] == tokens[1] == target.bos:  # template wrote BOS and so did add_special
            tokens = tokens[1:]
        return self._fitting(tokens, fit)

    def text(self, request: Request) -> str:
        """The request's prompt as text, before it is tokenized: raw, or rendered with the chat
        template (and the tools)."""
        return self._text(self.read_markup(request), MAX_CHARS_PER_TOKEN * self.target.n_ctx)

    def fim_tokens(self) -> FimTokens:
        """The target's fill-in-the-middle tokens; EdgespecError naming those it lacks."""
        fim = self.target.fim
        if missing := fim.missing():
            raise EdgespecError(
                f"{self.target.path.name} has no fill-in-the-middle tokens ({', '.join(missing)} missing); infill"
                " and suffix need a code model that has them, such as Qwen2.5-Coder"
            )
        return fim

    def layout(self, infill: Infill) -> FimPrompt:
        """A fill-in-the-middle prompt in the target's FIM tokens, on the anchor that keeps the most
        of it cached (see keystrokes.py and fim.py)."""
        target = self.target
        if infill.chars > MAX_CHARS_PER_TOKEN * target.n_ctx:
            raise self._too_long(f"{infill.chars} characters")
        if self.keystrokes is None:
            bos = target.bos if target.add_bos else None
            self.keystrokes = Keystrokes(self.fim_tokens(), target, target.n_ctx, bos)
        return self.keystrokes.prompt(infill, target.cache.cached)

    def _fitting(self, tokens: list[int], fit: bool = True) -> list[int]:
        """The prompt's tokens, refused if there are none, or (fit) more than the context holds."""
        if not tokens:
            raise EdgespecError("the prompt is empty; give some text")
        if fit and len(tokens) >= self.target.n_ctx:
            raise self._too_long(f"{len(tokens)} tokens")
        return tokens

    def _text(self, request: Request, max_chars: int) -> str:
        """The prompt as text: raw, or rendered with the chat template (and the tools)."""
        target = self.target
        if request.raw:
            text = request.prompt
        else:
            prompt = request.prompt
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            template = target.chat_template()
            if template is None:
                raise EdgespecError(f"{target.path.name} has no chat template; send plain text with --raw")
            bos, eos = (target.token_text(t).decode("utf-8", "replace") for t in (target.bos, target.eos))
            choice = request.tool_choice
            messages, tools = prepare(template, messages, list(request.tools) if request.calls_tools else None)
            try:
                text = render(template, messages, bos_token=bos, eos_token=eos, max_chars=max_chars, tools=tools)
            except PromptTooLong as e:
                raise self._too_long(f"{e.n_chars} characters") from None
            text += choice.opening if tools or choice.mode == "function" else ""
        if len(text) > max_chars:
            raise self._too_long(f"{len(text)} characters")
        return text

    def _too_long(self, size: str) -> PromptExceedsContext:
        return PromptExceedsContext(size, self.target.n_ctx, self.target.n_seq)
