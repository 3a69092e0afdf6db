"""The engine: exact speculative decoding of a target model with any drafter."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from time import monotonic, perf_counter

from . import calibration
from .chat import PromptTooLong, render
from .controller import Controller, Drafters
from .costs import MachineCosts, Recheck, answers_side_by_side
from .drafters import Conversation, CopyDrafter, Drafter, GrammarDrafter, HeadsDrafter, MemoryDrafter
from .errors import EdgespecError, PromptExceedsContext
from .fim import FimPrompt, Infill
from .grammar import Grammar, grammar_text
from .healing import Healed, Healing, heal, pieces_of
from .keystrokes import Keystrokes
from .logprobs import TokenLogprob
from .memory import Memory
from .model import Model, Pass
from .modes import DraftMode, Gamma, adaptive, check_mode, draft_modes
from .request import Prompt, Request
from .run import PREFILL_CHUNK, Event, Run
from .sequences import Sequences
from .stats import Stats
from .suffixes import DEPTH
from .tools import ToolCall, call_grammar, prepare
from .vocabulary import FimTokens

MAX_CHARS_PER_TOKEN = 256  # longer than any token of the tokenizers we know (Qwen2.5's longest: 128 bytes)
IDLE_PASS_S = 0.25  # idle work reads prompts in passes this long at most: a request that comes waits for one
MEMORY_SAVE_S = 60.0  # idle, the memory is saved once this long has passed since it last was (and at close)


@dataclass
class Generation:
    text: str  # with tools: the answer's text without its tool calls
    tokens: list[int]
    stats: Stats
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `tokens`, where the request asked for them
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the prompt's tokens (the first: None)

    @property
    def finish_reason(self) -> str | None:
        return self.stats.finish_reason


class Engine:
    """A target model, optionally with a drafter. Use as a context manager, or
    call close(), to free llama.cpp's memory.

    Use an engine (from load() on) from one thread (see engine_thread.py: the chat app
    and the server keep all engine work on an EngineThread, which also does its idle
    work, idle_step(), when nothing is queued)."""

    def __init__(
        self,
        target: Model,
        drafter: Drafter | None = None,
        *,
        gamma: Gamma | int | str | None = None,
        draft_mode: DraftMode | str = DraftMode.AUTO,
        owned: Sequence[Model] | None = None,
        timer: calibration.Timer = calibration.TIMER,
        memory: Memory | None = None,
    ) -> None:
        """target: the model whose output distribution is produced. drafter: the draft
        model's drafter (or any drafters.Drafter); the copy drafter (prompt lookup, predicted
        outputs) is always there. gamma (None or "auto") and draft_mode "auto" let the controller
        choose per round (the defaults of requests that leave them unset). owned: the models close() frees
        (default: the target). timer: what times the models' passes for the cost curves
        (calibration.Timer). memory: what earlier requests read and wrote (memory.py), drafted
        from and added to by every request that does not say otherwise (Request.memory); saved
        when idle and at close()."""
        self.draft_mode = check_mode(draft_mode, has_model=drafter is not None)
        self.gamma = Gamma.of(gamma) if gamma is not None else Gamma()
        self.target = target
        self.drafter = drafter
        self.forced = GrammarDrafter(target)
        self.conversation = Conversation()  # the copy drafters' index of the conversation, kept between requests
        self._owned = [target] if owned is None else list(owned)
        self.costs = MachineCosts(timer)
        self.keystrokes: Keystrokes | None = None  # an editor's requests' memory, from the first infill on
        self.sequences = Sequences(self.models)  # one per request answered at once (Model's n_seq)
        self._idle: IdleRun | None = None  # the idle work under way
        self.memory = memory

    @property
    def draft_model(self) -> Model | None:
        """The draft model, if the drafter runs one (the target's own heads are no model of their own)."""
        return self.drafter.model if self.drafter is not None else None

    @property
    def draft_name(self) -> str | None:
        """What drafts besides the copies, as the shells name it: the draft model's file, the
        target's own MTP heads, or None."""
        if isinstance(self.drafter, HeadsDrafter):
            return "its own MTP heads"
        return self.draft_model.path.name if self.draft_model is not None else None

    def upkeep(self, until: float | None = None) -> None:
        """The idle work there is: time again the costs the last answers found stale, and read
        ahead for an editor's next keystroke (keystrokes.py). For when the engine is idle (an
        EngineThread does it then, a step at a time; the command line after its answer).
        until: a time.perf_counter() to stop at (None: when it is all done)."""
        while (until is None or perf_counter() < until) and self.idle_step():
            pass

    def idle_step(self) -> bool:
        """One step of idle work (a cost re-check, or a prompt pass or round of an editor's next
        request, IDLE_PASS_S at most on this machine); False where there was none. A request
        started meanwhile stops the work in progress; what it read stays cached."""
        if self.costs.recheck is not Recheck.NONE:
            self.costs.upkeep()
            return True
        memory = self.memory
        if memory is not None and memory.dirty and monotonic() - memory.saved_at > MEMORY_SAVE_S:
            self._save_memory()
            return True
        if self._idle is None:
            work = self.keystrokes.next_idle() if self.keystrokes is not None else None
            if work is None:
                return False
            try:
                run = self._start(work.request, layout=work.layout, prefill_chunk=self._idle_chunk())
            except EdgespecError:
                return True
            self._idle = IdleRun(run, run.steps())
        idle = self._idle
        try:
            step = next(idle.steps)
        except (StopIteration, EdgespecError):
            self._idle = None
            return True
        if isinstance(step, Pass):
            self.decode([step])
        else:
            idle.text.append(step.text)
            if step.done:
                self._idle = None
                self.keystrokes.answered(idle.run.request, idle.run.layout, "".join(idle.text), idle=True)
        return True

    def answers_together(self, count: int) -> bool:
        """Whether `count` answers to one prompt (OpenAI's n, llama-server's n_cmpl) are made side
        by side, each in a sequence of its own, their steps decoded together: where this machine
        decodes them together for much less than one after another (costs.answers_side_by_side)
        and there are sequences for them all. Else one after another, each drafted from the one
        before (Request.answer)."""
        return 1 < count <= self.target.n_seq and answers_side_by_side(
            self.costs.curve(self.target), count, self.costs.spread(self.target)
        )

    def _idle_chunk(self) -> int:
        """Prompt tokens an idle pass reads: the most that take IDLE_PASS_S at most here (on a
        2-core CPU 6 to 8 tokens, on a GPU a whole PREFILL_CHUNK)."""
        costs = self.costs.of_request(self.target, None)
        sizes = [k for k in costs.pass_sizes(PREFILL_CHUNK) if costs.verify_pass(k) <= IDLE_PASS_S]
        return max(sizes, default=1)

    @property
    def draft_modes(self) -> tuple[DraftMode, ...]:
        """The draft modes this engine can speculate with (model and hybrid need a draft model)."""
        return draft_modes(has_model=self.drafter is not None)

    # --- public API -------------------------------------------------------
    def stream(self, request: Request | Prompt, **options) -> Iterator[Event]:
        """Generate the answer to `request` token by token (see Request), or to a prompt with
        Request.of's keywords (temperature=0, max_tokens=200, ...). The last event has token
        None, the remaining text and the final stats. A bad request raises EdgespecError here,
        before the first event."""
        return self.events(self.start(request, **options))

    def start(self, request: Request | Prompt, *, cancelled: threading.Event | None = None, **options) -> Run:
        """The request's Run, ready to give its events (the prompt rendered and checked, the grammar
        compiled). cancelled: set it from another thread to stop the run at its next prefill chunk or
        round (a server's client gone)."""
        self._stop_idle()
        return self._start(_request(request, options), cancelled=cancelled)

    def _stop_idle(self) -> None:
        """A request comes first: the idle work under way stops, and what it read is kept (a head
        is read a few tokens at a time, in the gaps between keystrokes)."""
        idle, self._idle = self._idle, None
        if idle is None:
            return
        if self.target.prompt_cache is not None and idle.run.sequence is not None:
            self.sequences.enter(idle.run.sequence)
            self.target.prompt_cache.keep(self.target)
        idle.steps.close()  # its sequence free for the request

    def _start(
        self,
        request: Request,
        *,
        cancelled: threading.Event | None = None,
        layout: FimPrompt | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> Run:
        """start()'s Run; layout: a fill-in-the-middle prompt as given (idle work reading a head)."""
        request = request.settled(self.draft_mode, self.gamma)
        check_mode(request.draft_mode, has_model=self.drafter is not None)
        target = self.target
        if isinstance(request.prompt, Infill):
            layout = layout or self._fim_prompt(request.prompt)
            tokens, healable = self._fitting(layout.tokens), len(layout.head.tokens)
        else:
            tokens, healable = self.prompt_tokens(request), 0
        gbnf = grammar_text(request.grammar, request.json_schema)
        if request.calls_tools and request.tool_choice.call_schema is not None:  # a call is forced: its grammar
            gbnf = call_grammar(request.tool_choice, request.parallel_tool_calls)
        constraint = Grammar(target, gbnf) if gbnf is not None else None
        healed = Healed(len(tokens), b"")
        if request.healed:  # the prompt's last word goes back: the answer writes it again, whole
            healed = heal(tokens, healable, pieces_of(target), target.piece)
            tokens = tokens[: healed.kept]
            constraint = Healing(pieces_of(target), healed.removed, target.piece) if healed.removed else None
        prediction = request.prediction
        if prediction is None and isinstance(request.prompt, Infill) and self.keystrokes is not None:
            prediction = self.keystrokes.prediction(request.prompt)  # where the user types what was suggested
        if prediction and healed.removed:  # the answer's tokens write the healed text first
            prediction = healed.removed.decode("utf-8", "ignore") + prediction
        prediction_tokens = target.text_tokens(prediction) if prediction else ()
        copy = CopyDrafter(vocab=target, prediction=prediction_tokens, conversation=self.conversation)
        memory = MemoryDrafter(self.memory) if self.memory is not None and request.memory else None
        controller = self._controller(request, Drafters(copy, self.drafter, self.forced, memory))
        return Run(
            target,
            request,
            tokens,
            controller,
            constraint,
            self.sequences,
            cancelled,
            healed=healed.removed,
            layout=layout,
            prefill_chunk=prefill_chunk,
        )

    def generate(self, request: Request | Prompt, **options) -> Generation:
        """Like stream(), but return the whole answer (with tools: its text and tool calls apart)."""
        run = self.start(request, **options)
        text, tokens, logprobs = [], [], []
        for event in self.events(run):
            text.append(event.text)
            if not event.done:
                tokens.append(event.token)
            if event.logprob is not None:
                logprobs.append(event.logprob)
        answer, calls = "".join(text), []
        if (parser := run.request.call_parser()) is not None:
            answer, calls = parser.split(answer, last=True)
        return Generation(answer, tokens, event.stats, calls, logprobs, run.prompt_logprobs)

    def chat(self, messages: Sequence[dict], **options) -> Generation:
        """Answer the last message of a conversation. Pass the whole conversation
        each turn: the KV cache of the common prefix is reused, not recomputed."""
        return self.generate(messages, **options)

    def prompt_tokens(self, request: Request | Prompt, *, fit: bool = True, **options) -> list[int]:
        """The request's prompt as the target reads it: rendered with the chat template (and
        the tools), tokenized, and checked against the context (fit=False: counted whatever
        its length, up to what the tokenizer is given at all)."""
        request, target = _request(request, options), self.target
        if isinstance(request.prompt, Infill):
            return self._fitting(self._fim_prompt(request.prompt).tokens, fit)
        # a text this long cannot fit in the context whatever its tokens: refused before
        # llama.cpp's tokenizer spends seconds (and memory) on it
        max_chars = MAX_CHARS_PER_TOKEN * target.n_ctx
        tokens = target.tokenize(self._prompt_text(request, max_chars), add_special=True, parse_special=True)
        if len(tokens) > 1 and tokens[0] == tokens[1] == target.bos:  # template wrote BOS and so did add_special
            tokens = tokens[1:]
        return self._fitting(tokens, fit)

    def _fitting(self, tokens: list[int], fit: bool = True) -> list[int]:
        """The prompt's tokens, refused if there are none, or (fit) more than the context holds."""
        if not tokens:
            raise EdgespecError("the prompt is empty; give some text")
        if fit and len(tokens) >= self.target.n_ctx:
            raise self._too_long(f"{len(tokens)} tokens")
        return tokens

    def _prompt_text(self, request: Request, max_chars: int) -> str:
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

    def fim_tokens(self) -> FimTokens:
        """The target's fill-in-the-middle tokens; EdgespecError naming those it lacks."""
        fim = self.target.fim
        if missing := fim.missing():
            raise EdgespecError(
                f"{self.target.path.name} has no fill-in-the-middle tokens ({', '.join(missing)} missing); infill"
                " and suffix need a code model that has them, such as Qwen2.5-Coder"
            )
        return fim

    def _fim_prompt(self, infill: Infill) -> FimPrompt:
        """A fill-in-the-middle prompt in the target's FIM tokens, on the anchor that keeps the most
        of it cached (see keystrokes.py and fim.py)."""
        target = self.target
        if infill.chars > MAX_CHARS_PER_TOKEN * target.n_ctx:
            raise self._too_long(f"{infill.chars} characters")
        if self.keystrokes is None:
            bos = target.bos if target.add_bos else None
            self.keystrokes = Keystrokes(self.fim_tokens(), target, target.n_ctx, bos)
        return self.keystrokes.prompt(infill, target.cached)

    def _too_long(self, size: str) -> PromptExceedsContext:
        return PromptExceedsContext(size, self.target.n_ctx)

    def _controller(self, request: Request, drafters: Drafters) -> Controller:
        planned = adaptive(request.draft_mode, request.gamma)  # else nothing is planned: no costs needed
        costs = self.costs.of_request(self.target, self.drafter) if planned else None
        trees = request.trees and self.target.can_branch
        return Controller(request.draft_mode, request.gamma, costs, drafters, trees=trees)

    def events(self, run: Run) -> Iterator[Event]:
        """The events of a started Run (what stream() gives): a caller that must know the
        request is good before its prefill (the server) starts it, then takes its events."""
        for step in self.steps(run):
            if isinstance(step, Pass):
                self.decode([step])
            else:
                yield step

    def steps(self, run: Run) -> Iterator[Event | Pass]:
        """events(), with the run's passes (the target's, the draft model's) handed out to be decoded
        (decode()): a scheduler
        that runs several requests at once (engine_thread.py) takes each a pass at a time, and
        decodes their passes together."""
        text = []
        for event in run.steps():
            if isinstance(event, Pass):
                yield event
                continue
            text.append(event.text)
            if event.done:  # before the last event goes out: an engine thread re-checks once the answer is in
                self.costs.answered(run.stats.prefill_s + run.stats.decode_s, run.controller.costs)
                if run.layout is not None and run.stats.finish_reason != "cancelled":  # an editor's next keystroke
                    self.keystrokes.answered(run.request, run.layout, "".join(text))
                self._remember(run)
            yield event

    def _remember(self, run: Run) -> None:
        """The run's prompt and answer into the memory (a hang-up's partial answer too), as the
        target read and wrote them (its end of generation included); an editor's prompt, sent
        again at every keystroke, only as far back as a match is looked for."""
        if self.memory is None or not run.request.memory:
            return
        answered = len(run.prompt) + run.stats.n_tokens + (run.stats.finish_reason == "stop")
        start = max(0, len(run.prompt) - DEPTH) if run.layout is not None else 0
        self.memory.remember(run.seq[start:answered])

    def _save_memory(self) -> None:
        """The memory to disk; a failure (a full disk, a folder not writable) is said in one line."""
        try:
            self.memory.save()
        except OSError as e:
            self.memory.saved_at = monotonic()  # (not tried again at once)
            print(f"edgespec: the memory could not be saved ({e}); it is kept in this process", file=sys.stderr)

    def decode(self, passes: list[Pass]) -> None:
        """The passes of several runs (steps()), each model's decoded together (Model.decode)."""
        for model in self.models:
            if mine := [one for one in passes if one.model is model]:
                model.decode(mine)

    @property
    def models(self) -> list[Model]:
        """The target, and the draft model if there is one."""
        return [m for m in (self.target, self.draft_model) if m is not None]

    def forget(self) -> None:
        """Empty the KV caches and the saved prompts: the next prompt is evaluated from
        scratch (as bench needs, to time prefill), with no memory of an editor's keystrokes."""
        self._stop_idle()
        if self.keystrokes is not None:
            self.keystrokes.forget()
        for seq in range(self.sequences.count):
            self.sequences.enter(seq)
            for model in self.models:
                model.truncate(0)
        for model in self.models:
            if model.prompt_cache is not None:
                model.prompt_cache.drop(model)

    def save_prompts(self) -> int:
        """Keep the prompt cache, the live prompts with it, on disk for the next engine of these
        model files (see prompt_cache.py); the bytes kept (0 without a prompt cache)."""
        cache = self.target.prompt_cache
        return cache.save_to_disk(self.models) if cache is not None else 0

    def load_prompts(self) -> int:
        """Take in the prompts an engine of these model files kept on disk; how many."""
        cache = self.target.prompt_cache
        return cache.load_from_disk(self.models) if cache is not None else 0

    def close(self) -> None:
        """Keep what real rounds taught about costs and the memory, then free llama.cpp's memory."""
        self.costs.save()
        if self.memory is not None:
            self._save_memory()
        if isinstance(self.drafter, HeadsDrafter):  # (a context on the target's weights: freed before them)
            self.drafter.heads.close()
        for model in self._owned:
            model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class IdleRun:
    """Idle work under way: its run, the run's steps still to take, and the text so far."""

    run: Run
    steps: Iterator[Event | None]
    text: list[str] = field(default_factory=list)


def _request(request: Request | Prompt, options: dict) -> Request:
    """A Request as it is, or one made of a prompt and Request.of's keywords."""
    if not isinstance(request, Request):
        return Request.of(request, **options)
    if options:
        raise EdgespecError("give a Request or keyword options, not both")
    return request
