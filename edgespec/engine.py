"""The engine: exact speculative decoding of a target model with any drafter."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from time import monotonic, perf_counter

from . import calibration
from .controller import Controller, Drafters
from .costs import MachineCosts, Recheck, answers_side_by_side
from .drafters import Conversation, CopyDrafter, Drafter, GrammarDrafter, MemoryDrafter
from .errors import EdgespecError
from .fim import FimPrompt
from .known_rows import KnownRows
from .logprobs import TokenLogprob
from .memory import Memory
from .model import Model
from .modes import DraftMode, Gamma, adaptive, check_mode, draft_modes
from .passes import Pass
from .prompts import Prompts
from .request import Defaults, Prompt, Request
from .run import PREFILL_CHUNK, Event, Run
from .sequences import Sequences
from .stats import Stats
from .tools import ToolCall

# idle work reads prompts in passes this long at most: a request that comes meanwhile waits for the pass
# (on a 2-core AMD EPYC 0.25 s made an editor's keystroke wait 100 ms at p50 between keystrokes 0.5 s apart)
IDLE_PASS_S = 0.1
# re-checks of the costs (a few passes of up to 64 tokens) wait for this long without a request: not
# between an editor's keystrokes or an agent's calls (upkeep(), told the engine is idle, does not wait)
RECHECK_QUIET_S = 2.0
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
        # what requests get for what they leave unset (a server adds its own: Api)
        gamma = Gamma.of(gamma) if gamma is not None else Gamma()
        self.defaults = Defaults(check_mode(draft_mode, has_model=drafter is not None), gamma)
        self.target = target
        self.drafter = drafter
        self.forced = GrammarDrafter(target)
        self.conversation = Conversation()  # the copy drafters' index of the conversation, kept between requests
        self._owned = [target] if owned is None else list(owned)
        self.costs = MachineCosts(timer)
        self.prompts = Prompts(target)  # requests made ready to run, an editor's keystrokes kept
        self.sequences = Sequences(self.models)  # one per request answered at once (Model's n_seq)
        self.known_rows = KnownRows(target.n_vocab)  # the rows of the latest answers, for the next to the same prompt
        self._idle: IdleRun | None = None  # the idle work under way
        self._requested_at = -RECHECK_QUIET_S  # monotonic() when a request last started or ended
        self.memory = memory

    @property
    def draft_model(self) -> Model | None:
        """The draft model, if the drafter runs one (the target's own heads are no model of their own)."""
        return self.drafter.model if self.drafter is not None else None

    @property
    def draft_name(self) -> str | None:
        """What drafts besides the copies, as the shells name it: the draft model's file, the
        target's own MTP heads, or None."""
        return self.drafter.name if self.drafter is not None else None

    def upkeep(self, until: float | None = None) -> None:
        """The idle work there is: time again the costs the last answers found stale, and read
        ahead for an editor's next keystroke (keystrokes.py). For when the engine is idle (an
        EngineThread does it then, a step at a time; the command line after its answer).
        until: a time.perf_counter() to stop at (None: when it is all done)."""
        while (until is None or perf_counter() < until) and self.idle_step(quiet_s=0.0):
            pass

    def idle_step(self, quiet_s: float = RECHECK_QUIET_S) -> bool:
        """One step of idle work (a cost re-check, a saved prompt state written to disk, the memory
        saved, or a prompt pass or round of an editor's next request, IDLE_PASS_S at most on this
        machine); False where there was none. A request
        started meanwhile stops the work in progress; what it read stays cached. quiet_s: how long
        the engine must have had no request before a cost re-check."""
        if self.costs.recheck is not Recheck.NONE and monotonic() - self._requested_at >= quiet_s:
            self.costs.upkeep()
            return True
        if self.target.prompt_cache is not None and self.target.prompt_cache.spill():
            return True
        if self._memory_due() == 0.0:
            self.memory.save_or_say()
            return True
        if self._idle is None:
            work = self.prompts.keystrokes.next_idle() if self.prompts.keystrokes is not None else None
            if work is None:
                return False
            try:
                chunk = self.costs.of_request(self.target).longest_pass(IDLE_PASS_S, PREFILL_CHUNK)
                run = self._start(work.request, layout=work.layout, prefill_chunk=chunk)
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
                self.prompts.keystrokes.answered(idle.run.request, idle.run.layout, "".join(idle.text), idle=True)
        return True

    def idle_due(self) -> float | None:
        """Seconds until idle work that waits for time to pass is due (a saved prompt state to
        write to disk, the memory to save), where idle_step() has none now; None: there is none."""
        cache = self.target.prompt_cache
        due = [cache.spill_due() if cache is not None else None, self._memory_due(), self._recheck_due()]
        return min((d for d in due if d is not None), default=None)

    def _recheck_due(self) -> float | None:
        """Seconds until a cost re-check may run (RECHECK_QUIET_S without a request); None: none is due."""
        if self.costs.recheck is Recheck.NONE:
            return None
        return max(0.0, self._requested_at + RECHECK_QUIET_S - monotonic())

    def _memory_due(self) -> float | None:
        """Seconds until the memory is saved (MEMORY_SAVE_S after it last was); None: nothing to save."""
        if self.memory is None or not self.memory.dirty:
            return None
        return max(0.0, self.memory.saved_at + MEMORY_SAVE_S - monotonic())

    def answers_together(self, count: int) -> bool:
        """Whether `count` answers to one prompt (OpenAI's n, llama-server's n_cmpl) are made side
        by side, each in a sequence of its own, their steps decoded together: where this machine
        decodes them together for much less than one after another (costs.answers_side_by_side)
        and there are sequences for them all. Else one after another, each drafted from the one
        before (Request.answer)."""
        return 1 < count <= self.target.n_seq and answers_side_by_side(
            self.costs.curve(self.target), count, self.costs.spread(self.target)
        )

    @property
    def draft_modes(self) -> tuple[DraftMode, ...]:
        """The draft modes this engine can speculate with (model and hybrid need a draft model)."""
        return draft_modes(has_model=self.drafter is not None)

    # --- public API -------------------------------------------------------
    def stream(self, request: Request | Prompt, **options) -> Iterator[Event]:
        """Generate the answer to `request` token by token (see Request), or to a prompt with
        Request.of's keywords (temperature=0, max_tokens=200, ...). The last event has token
        None, the remaining text and the final stats. A bad request raises EdgespecError here,
        before the first event. Its first token is planned to come soon (Request.streamed)."""
        return self.events(self.start(replace(_request(request, options), streamed=True)))

    def start(self, request: Request | Prompt, *, cancelled: threading.Event | None = None, **options) -> Run:
        """The request's Run, ready to give its events (the prompt rendered and checked, the grammar
        compiled). cancelled: set it from another thread to stop the run at its next prefill chunk or
        round (a server's client gone)."""
        self._stop_idle()
        self._requested_at = monotonic()
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
        request = self.prompts.read_markup(request.settled(self.defaults))
        check_mode(request.draft_mode, has_model=self.drafter is not None)
        prepared = self.prompts.prepare(request, layout)
        copy = CopyDrafter(vocab=self.target, prediction=prepared.prediction, conversation=self.conversation)
        memory = MemoryDrafter(self.memory) if self.memory is not None and request.memory else None
        drafters = Drafters(copy, self.drafter, self.forced, memory)
        planned = adaptive(request.draft_mode, request.gamma)  # else nothing is planned: no costs needed
        costs = self.costs.of_request(self.target, self.drafter) if planned else None
        request.sampling.penalties.check(self.target.n_vocab)
        # (a row's penalties follow the tokens before it: a chain's, see run.TargetRows)
        trees = request.trees and self.target.can_branch and not request.sampling.penalties.active
        controller = Controller(request.draft_mode, request.gamma, costs, drafters, trees=trees)
        return Run(
            self.target,
            request,
            prepared.tokens,
            controller,
            prepared.constraint,
            self.sequences,
            cancelled,
            healed=prepared.healed,
            layout=prepared.layout,
            prefill_chunk=prefill_chunk,
            known=self.known_rows if request.draft_mode is not DraftMode.OFF else None,  # (off: the target alone)
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
        return self.prompts.tokens(_request(request, options), fit)

    def prompt_text(self, request: Request | Prompt, **options) -> str:
        """The request's prompt as text, before it is tokenized: raw, or rendered with the chat
        template (and the tools), as llama-server's /apply-template gives it."""
        return self.prompts.text(_request(request, options))

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
            if event.done:  # before the last event goes out: idle work re-checks the costs once all is quiet
                self._requested_at = monotonic()
                self.costs.answered(run.stats.prefill_s + run.stats.decode_s, run.controller.costs)
                if run.layout is not None and run.stats.finish_reason != "cancelled":  # an editor's next keystroke
                    self.prompts.keystrokes.answered(run.request, run.layout, "".join(text))
                if self.memory is not None and run.request.memory:
                    self.memory.remember(run.remembered())
            yield event

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
        if self.prompts.keystrokes is not None:
            self.prompts.keystrokes.forget()
        for seq in range(self.sequences.count):
            self.sequences.enter(seq)
            for model in self.models:
                model.cache.truncate(0)
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
            self.memory.save_or_say()
        if self.drafter is not None:
            self.drafter.close()
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
