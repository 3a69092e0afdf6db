"""The engine: exact speculative decoding of a target model with any drafter."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from . import calibration
from .chat import Message, PromptTooLong, render
from .controller import Controller, check_mode, draft_modes
from .cost_curve import RollbackCost
from .drafters import CopyDrafter, Drafter, GrammarDrafter
from .errors import EdgespecError
from .grammar import Grammar, grammar_text
from .model import ContextFull, Model
from .sampling import DEFAULT as DEFAULT_SAMPLING
from .sampling import (
    SamplingParams,
    constrained,
    constrained_argmax,
    distribution,
    position_uniforms,
    verify,
    verify_greedy,
)
from .stats import RoundTiming, Stats
from .text import TextStream
from .tools import CLOSE, ToolCall, ToolCallParser, ToolChoice, call_grammar, prepare, tool_choice_of

Prompt = str | Sequence[Message]
NO_TOOL_CHOICE = ToolChoice()
RECHECK_SHARE = 0.05  # at most this share of an engine's time goes to timing costs again
MAX_CHARS_PER_TOKEN = 256  # longer than any token of the tokenizers we know (Qwen2.5's longest: 128 bytes)


def check_gamma(gamma: int) -> int:
    if gamma < 1:
        raise EdgespecError(f"gamma must be >= 1, got {gamma}; use --no-draft to switch speculation off")
    return gamma


def check_max_tokens(max_tokens: int | None) -> int | None:
    if max_tokens is not None and max_tokens < 1:
        raise EdgespecError(f"max-tokens must be >= 1, got {max_tokens}")
    return max_tokens


@dataclass
class Event:
    """One streamed step: a generated token, or (token None) the end of generation."""

    text: str  # newly printable text; may be "" while bytes or a possible stop string are held back
    token: int | None
    source: str | None  # "draft": an accepted draft token; "target": sampled by the target itself
    stats: Stats = field(repr=False)  # the live statistics of this generation

    @property
    def done(self) -> bool:
        return self.token is None


@dataclass
class Generation:
    text: str  # with tools: the answer's text without its tool calls
    tokens: list[int]
    stats: Stats
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        return self.stats.finish_reason


class Engine:
    """A target model, optionally with a drafter. Use as a context manager, or
    call close(), to free llama.cpp's memory.

    Use an engine (from load() on) from one thread (see engine_thread.py: the chat app
    and the server keep all engine work on an EngineThread)."""

    def __init__(
        self,
        target: Model,
        drafter: Drafter | None = None,
        *,
        gamma: int | None = None,
        draft_mode: str = "auto",
        owned: Sequence[Model] | None = None,
    ) -> None:
        """target: the model whose output distribution is produced. drafter: the draft
        model's drafter (or any object with prefill/draft); the copy drafter (prompt
        lookup, predicted outputs) is always there. gamma None and draft_mode "auto"
        let the controller choose per round.
        owned: the models close() frees (default: the target)."""
        check_mode(draft_mode, has_model=drafter is not None)
        self.target = target
        self.drafter = drafter
        self.copy = CopyDrafter(vocab=target)
        self.forced = GrammarDrafter(target)
        self.gamma = gamma
        self.draft_mode = draft_mode
        self._owned = [target] if owned is None else list(owned)
        self._costs: dict[tuple, calibration.CostCurve] = {}
        self._rollback_costs: dict[Model, RollbackCost | None] = {}
        # seconds of answering since the last cost re-check, less what re-checks cost / RECHECK_SHARE:
        # many short answers must not each pay for one
        self._recheck_credit = 0.0
        self.recheck: str | None = None  # a cost re-check due: "all" points, or those "due" by age
        # shells that keep an engine thread (EngineThread) re-check when idle, not after each answer
        self.defer_rechecks = False

    def recheck_costs(self) -> None:
        """Time again the costs the last answer found stale (see calibration.recheck), if any."""
        curves = [(model, curve) for (model, _), curve in self._costs.items()]
        recheck, self.recheck = self.recheck, None
        if recheck == "all":
            for _, curve in curves:
                curve.mark_stale()
            calibration.recheck(curves, every=True)
        elif recheck == "due":
            start = perf_counter()
            calibration.recheck(curves)
            self._recheck_credit -= (perf_counter() - start) / RECHECK_SHARE

    @property
    def draft_modes(self) -> tuple[str, ...]:
        """The draft modes this engine can speculate with (model and hybrid need a draft model)."""
        return draft_modes(has_model=self.drafter is not None)

    def cost_curve(self, model: Model, sizes=calibration.TARGET_SIZES) -> calibration.CostCurve:
        """V(k) of `model` on this machine: cached, else measured now (once)."""
        if (model, sizes) not in self._costs:
            self._costs[model, sizes] = calibration.load_or_measure(model, sizes)
        return self._costs[model, sizes]

    def rollback_cost(self, model: Model) -> RollbackCost | None:
        """What cutting `model`'s recurrent state back costs here (None: attention alone): cached, else measured now."""
        if model not in self._rollback_costs:
            self._rollback_costs[model] = calibration.load_or_measure_rollback(model)
        return self._rollback_costs[model]

    # --- public API -------------------------------------------------------
    def stream(
        self,
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
        tools: list[dict] | None = None,
        tool_choice: ToolChoice | str | dict | None = None,
        parallel_tool_calls: bool = True,
        grammar: str | None = None,
        json_schema: dict | str | None = None,
    ) -> Iterator[Event]:
        """Generate an answer to `prompt` token by token.

        prompt: a user message (str) or a list of {"role", "content"} messages,
        rendered with the model's chat template; with raw=True a str is sent as
        plain completion text (special-token markup such as <|im_start|> parsed).
        max_tokens: the answer's length at most; None: until the model stops or the
        context is full (finish_reason "context").
        gamma: draft tokens per round, or "auto"; draft_mode: auto, model, copy,
        hybrid or off (defaults: the engine's). prediction: text the answer will
        largely repeat (OpenAI's Predicted Outputs, e.g. the file being edited):
        drafts are copied from it; the output is the same with or without it. speculative=False runs the target
        alone, the baseline. The last event has token None, the remaining text
        and the final stats.
        tools: OpenAI's function tools, rendered through the model's chat template (see
        tools.py); tool_choice: OpenAI's (auto, none, required or a named function) or a
        ToolChoice. "required" and a function start the answer with the call's opening
        and constrain the rest to the calls allowed (tools.call_grammar); the events do
        not repeat the opening: read them with ToolCallParser(choice.opening), or
        use generate(), which returns the calls parsed. A named function, or
        parallel_tool_calls=False, ends the answer with the (first) call.
        grammar: GBNF text (root rule `root`) the answer must match; json_schema: a JSON
        schema (dict or JSON text) the answer must be an instance of, written on one line
        in json.dumps's style ({"type": "object"}: any JSON object). The answer is drawn from
        the target's law masked by the grammar, exactly, with or without speculation; text
        the grammar forces (keys, punctuation) is drafted for free (see grammar.py)."""
        gamma = self.gamma if gamma is None else gamma
        gamma = None if gamma in (None, "auto") else check_gamma(gamma)
        mode = "off" if not speculative else (draft_mode or self.draft_mode)
        check_max_tokens(max_tokens)
        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        choice = tool_choice_of(tools, tool_choice)
        tokens = self.prompt_tokens(prompt, raw=raw, tools=tools, tool_choice=choice)
        if tools and choice.mode != "none" and (choice.one_call or not parallel_tool_calls):
            stop = [*stop, CLOSE]
        gbnf = grammar_text(grammar, json_schema)
        if tools and choice.call_schema is not None:  # a call is forced: its grammar
            if gbnf is not None:
                raise EdgespecError("a forced tool call cannot also follow a grammar or schema; give one of them")
            gbnf = call_grammar(choice, parallel_tool_calls)
        constraint = Grammar(self.target, gbnf) if gbnf is not None else None
        controller = self._controller(mode, gamma)
        self.copy.set_prediction(self.target.tokenize(prediction, add_special=False) if prediction else None)
        return self._generate(tokens, controller, params, max_tokens, stop, constraint)

    def generate(self, prompt: Prompt, **kwargs) -> Generation:
        """Like stream(), but return the whole answer (with tools: its text and tool calls apart)."""
        text, tokens = [], []
        for event in self.stream(prompt, **kwargs):
            text.append(event.text)
            if not event.done:
                tokens.append(event.token)
        choice = tool_choice_of(kwargs.get("tools"), kwargs.get("tool_choice"))  # as stream() read it
        if choice.mode == "none":
            return Generation("".join(text), tokens, event.stats)
        parser = ToolCallParser(choice.opening, parallel=kwargs.get("parallel_tool_calls", True))
        head, _ = parser.feed("".join(text))
        tail, _ = parser.finish()
        return Generation(head + tail, tokens, event.stats, parser.calls)

    def chat(self, messages: Sequence[Message], **kwargs) -> Generation:
        """Answer the last message of a conversation. Pass the whole conversation
        each turn: the KV cache of the common prefix is reused, not recomputed."""
        return self.generate(messages, **kwargs)

    def prompt_tokens(
        self, prompt: Prompt, *, raw: bool = False, tools: list[dict] | None = None, tool_choice=NO_TOOL_CHOICE
    ) -> list[int]:
        target = self.target
        # a text this long cannot fit in the context whatever its tokens: refused before
        # llama.cpp's tokenizer spends seconds (and memory) on it
        max_chars = MAX_CHARS_PER_TOKEN * target.n_ctx
        if raw:
            if not isinstance(prompt, str):
                raise EdgespecError("a raw prompt must be a string, not a list of messages")
            text = prompt
        else:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            template = target.chat_template()
            if template is None:
                raise EdgespecError(f"{target.path.name} has no chat template; send plain text with --raw")
            bos, eos = (target.token_text(t).decode("utf-8", "replace") for t in (target.bos, target.eos))
            messages, tools = prepare(template, messages, tools if tool_choice.mode != "none" else None)
            try:
                text = render(template, messages, bos_token=bos, eos_token=eos, max_chars=max_chars, tools=tools)
            except PromptTooLong as e:
                raise self._too_long(f"{e.n_chars} characters") from None
            text += tool_choice.opening if tools or tool_choice.mode == "function" else ""
        if len(text) > max_chars:
            raise self._too_long(f"{len(text)} characters")
        tokens = target.tokenize(text, add_special=True, parse_special=True)
        if not tokens:
            raise EdgespecError("the prompt is empty; give some text")
        if len(tokens) > 1 and tokens[0] == tokens[1] == target.bos:  # template wrote BOS and so did add_special
            tokens = tokens[1:]
        if len(tokens) >= target.n_ctx:
            raise self._too_long(f"{len(tokens)} tokens")
        return tokens

    def _too_long(self, size: str) -> EdgespecError:
        return EdgespecError(
            f"the prompt is {size} but the context holds {self.target.n_ctx} tokens; shorten the prompt or raise --ctx"
        )

    def _controller(self, mode: str, gamma: int | None) -> Controller:
        adaptive = mode != "off" and (mode == "auto" or gamma is None)
        draft_model = getattr(self.drafter, "model", None)
        verify_cost = self.cost_curve(self.target) if adaptive else None
        draft_cost = self.cost_curve(draft_model, calibration.DRAFT_SIZES) if adaptive and draft_model else None
        rollbacks = [self.rollback_cost(m) if adaptive and m else None for m in (self.target, draft_model)]
        return Controller(mode, gamma, verify_cost, draft_cost, self.drafter, self.copy, self.forced, *rollbacks)

    def forget(self) -> None:
        """Empty the KV caches and the saved prompts: the next prompt is evaluated from
        scratch (as bench needs, to time prefill)."""
        for model in (self.target, getattr(self.drafter, "model", None)):
            if model is not None:
                model.truncate(0)
                if model.prompt_cache is not None:
                    model.prompt_cache.drop(model)

    def close(self) -> None:
        """Keep what real rounds taught about costs, then free llama.cpp's memory."""
        for (model, sizes), curve in self._costs.items():
            calibration.save(model, sizes, curve)
        self._costs.clear()
        for model in self._owned:
            model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- generation -------------------------------------------------------
    def _generate(self, prompt, controller: Controller, params, max_tokens, stop, grammar) -> Iterator[Event]:
        target = self.target
        stats = Stats(
            mode="target-only" if controller.mode == "off" else "speculative",
            gamma="auto" if controller.gamma is None else controller.gamma,
            draft_mode=controller.mode,
            n_prompt=len(prompt),
            flash_attn=target.flash_attn,
            repack=target.repack,
            rollback=target.rollback.value,
        )
        if controller.V is not None:
            stats.baseline_tokens_per_s = controller.off_rate()
            if (rollback := controller.verify_rollback) is not None:
                stats.checkpoint_steps = rollback.checkpoint_s / controller.V(1)
                stats.restore_steps = rollback.restore_s / controller.V(1)
        # the answer's randomness is a function of the seed and each token's position (see
        # sampling.position_uniforms); drafts from the model draw from a stream of their own
        seed = secrets.randbits(63) if params.seed is None else params.seed
        rng = np.random.default_rng([seed, 1 << 62])

        start = perf_counter()
        # the target's cache holds everything but the last token, which opens the first verify batch
        stats.n_prompt_cached = target.sync(prompt)
        target.eval(prompt[stats.n_prompt_cached : -1])
        controller.prefill(prompt)
        stats.prefill_s = perf_counter() - start

        start = perf_counter()
        text = TextStream(stop)
        n_out = 0
        seq = list(prompt)
        try:
            limit = len(prompt) + max_tokens if max_tokens else target.n_ctx + 1
            rounds = speculative_decode(target, controller, seq, params, seed, rng, stats, limit, grammar)
            for new_tokens in rounds:
                for token, from_draft in new_tokens:
                    if target.is_eog(token):
                        stats.finish_reason = "stop"
                        break
                    n_out += 1
                    stats.n_tokens, stats.decode_s = n_out, perf_counter() - start
                    yield Event(text.push(target.piece(token)), token, "draft" if from_draft else "target", stats)
                    if text.stopped:
                        stats.finish_reason = "stop_string"
                    elif n_out == max_tokens:
                        stats.finish_reason = "length"
                    if stats.finish_reason:
                        break
                if stats.finish_reason:
                    break
        except ContextFull:
            stats.finish_reason = "context"
        self._recheck_credit += stats.prefill_s + stats.decode_s
        if controller.V is not None:
            # timed on a busy machine: all of it again, whatever the budget (once: then it is right);
            # else what was measured long ago, within the budget
            self.recheck = "all" if controller.costs_look_stale() else "due" if self._recheck_credit >= 0 else None
        yield Event(text.flush(), None, None, stats)
        if not self.defer_rechecks:  # after the final event: a re-check never delays an answer
            self.recheck_costs()


def speculative_decode(
    target: Model,
    controller: Controller,
    seq: list[int],
    params: SamplingParams,
    seed: int,
    rng: np.random.Generator,
    stats: Stats,
    limit: int,
    grammar: Grammar | None = None,
) -> Iterator[list[tuple[int, bool]]]:
    """Rounds of draft -> verify -> accept. `seq` (prompt + output) grows in place;
    the target's KV cache holds seq[:-1]. Yields each round's new tokens as
    (token, came from the draft); 1..γ+1 of them per round. Under a grammar (in its
    state after seq; advanced here) the target's law at every row is p_g. Raises ContextFull."""
    while True:
        if grammar is not None and grammar.finished():  # only an end may follow: the target would pick one
            yield [(target.eos, False)]
            return
        t0 = perf_counter()
        # the controller picks a drafter and γ (or none); drafts past the context or the budget are wasted
        room = min(target.n_ctx - len(seq), limit - len(seq) - 1)
        draft = controller.propose(seq, room, params, rng, grammar)
        t1 = perf_counter()

        # a recurrent state cannot be cut back: keep a way back before a pass that may be rejected
        if draft.tokens:
            target.checkpoint(len(draft.tokens) + 1)
        t_pass = perf_counter()

        # ONE target forward over [last token, x_1..x_γ]: row i is p(. | seq, x_1..x_i)
        rows = TargetRows(target.eval([seq[-1]] + draft.tokens, all_logits=True), params, grammar, draft.tokens)
        if params.greedy:  # accept while x_i == argmax p_i; the next token is the target's argmax
            n, next_token = verify_greedy(draft.tokens, rows.argmax)
        else:  # accept x_i w.p. min(1, p_i(x)/q_i(x)); else resample norm(max(p_i - q_i, 0)); bonus from p_γ
            uniforms = position_uniforms(seed, len(seq), len(draft.tokens) + 1)
            n, next_token = verify(draft.tokens, draft.q, rows.p, uniforms)
        rows.advance(n, next_token)
        t2 = perf_counter()

        # drop the rejected drafts from the target's cache (the drafter trims its own)
        target.truncate(len(seq) + n)
        seq += draft.tokens[:n] + [next_token]
        timing = RoundTiming(draft=t1 - t0, verify=t2 - t_pass, rollback=(t_pass - t1) + (perf_counter() - t2))
        controller.observe(draft, n, timing)
        stats.record_round(
            draft.source, len(draft.tokens), n, timing, controller.alphas(), controller.predicted.speedup
        )
        yield [(token, True) for token in draft.tokens[:n]] + [(next_token, False)]


class TargetRows:
    """The target's law at each row of a verify pass, made only when verification gets
    there. Under a grammar, row i is p_g in the grammar's state after draft[:i]: the
    grammar walks along the draft as far as it is accepted, never past a rejection, so
    it has nothing to roll back."""

    def __init__(self, logits: np.ndarray, params: SamplingParams, grammar: Grammar | None, draft: list[int]) -> None:
        self.logits, self.params, self.grammar, self.draft = logits, params, grammar, draft
        self.walked = 0  # draft tokens the grammar has taken

    def p(self, i: int) -> np.ndarray:
        if self.grammar is None:
            return distribution(self.logits[i], self.params)
        self._walk(i)
        return constrained(self.logits[i], self.params, self.grammar.allows)

    def argmax(self, i: int) -> int:
        if self.grammar is None:
            return int(np.argmax(self.logits[i]))
        self._walk(i)
        return constrained_argmax(self.logits[i], self.grammar.allows)

    def advance(self, n_accepted: int, next_token: int) -> None:
        """Take the round's tokens into the grammar: the accepted draft, then the next token."""
        if self.grammar is not None:
            self._walk(n_accepted)
            self.grammar.accept(next_token)

    def _walk(self, i: int) -> None:
        while self.walked < i:
            self.grammar.accept(self.draft[self.walked])
            self.walked += 1
