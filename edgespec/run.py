"""One request's generation, from prefill to its last event: a Run owns what lives only as
long as the request (the controller and its copy drafter, the grammar's state, the
sequence, the statistics, the text stream); the engine owns the models and what is
learnt across requests."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from time import perf_counter
from typing import TypeVar

import numpy as np

from .controller import Controller
from .costs import Batch
from .drafters import Draft
from .fim import FimPrompt
from .known_rows import Ahead, KnownRows
from .logprobs import TokenLogprob, token_logprobs
from .model import Model
from .modes import DraftMode, Source
from .passes import ContextFull, Pass
from .request import Request
from .sampling import Constraint, Law, SamplingParams, law, position_uniforms, verify_tree, verify_tree_greedy
from .sequences import Sequences
from .stats import RoundClock, Stats, trailing_repeat
from .suffixes import DEPTH
from .text import TextStream

PREFILL_CHUNK = 256  # prompt tokens a prefill pass reads: a cancelled run stops after one
T = TypeVar("T")


@dataclass
class Event:
    """One streamed step: a generated token, or (token None) the end of generation."""

    text: str  # newly printable text; may be "" while bytes or a possible stop string are held back
    token: int | None
    source: str | None  # "draft": an accepted draft token; "target": sampled by the target itself
    stats: Stats = field(repr=False)  # the live statistics of this generation
    logprob: TokenLogprob | None = None  # where the request asked for log-probabilities (Request.logprobs)

    @property
    def done(self) -> bool:
        return self.token is None


@dataclass(frozen=True)
class NewToken:
    """A token a round adds to the answer."""

    token: int
    from_draft: bool  # an accepted draft token (else the target's own draw)
    logprob: TokenLogprob | None  # where the request asked for log-probabilities


class Run:
    """A request's answer, token by token (steps()), and what speculation did (stats)."""

    def __init__(
        self,
        target: Model,
        request: Request,
        prompt: list[int],
        controller: Controller,
        constraint: Constraint | None,
        sequences: Sequences,
        cancelled: threading.Event | None = None,
        *,
        healed: bytes = b"",
        layout: FimPrompt | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        known: KnownRows | None = None,
    ) -> None:
        """request: with the engine's defaults settled (Request.settled); prompt: its tokens;
        constraint: what the answer is held to (its grammar, or its token healing); sequences: the
        models' sequences, of which the run holds one from its first pass to its end; healed: the
        bytes taken back from the prompt, which the answer begins with and does not return (see
        healing.py); layout: a fill-in-the-middle prompt's parts; prefill_chunk: prompt tokens
        a prefill pass reads; cancelled: set from another thread (a client gone) to stop the
        run early; known: the rows of earlier answers, which it adds its own to (and, asked again:
        Request.again, is drawn from where it goes their way)."""
        self.target, self.request, self.controller, self.constraint = target, request, controller, constraint
        self.cancelled, self.layout, self.prefill_chunk, self.known = cancelled, layout, prefill_chunk, known
        self.sequences, self.sequence = sequences, None  # which one it holds: from its first pass on
        self.params: SamplingParams = request.sampling
        self.prompt = prompt
        self.seq = list(prompt)  # prompt + output; the target's cache holds seq[:-1] (or less, see rounds)
        max_tokens = request.max_tokens
        self.limit = len(prompt) + max_tokens if max_tokens is not None else target.n_ctx + 1
        # the answer's randomness is a function of the seed and each token's position (see
        # sampling.position_uniforms); drafts from the model draw from a stream of their own
        self.seed = secrets.randbits(63) if self.params.seed is None else self.params.seed
        self.rng = np.random.default_rng([self.seed, 1 << 62])
        self.stats = Stats(
            mode="target-only" if request.draft_mode is DraftMode.OFF else "speculative",
            gamma=request.gamma.value,
            draft_mode=request.draft_mode,
            n_prompt=len(prompt),
            flash_attn=target.flash_attn,
            repack=target.repack,
            rollback=target.cache.rollback.value,
        )
        if (costs := controller.costs) is not None:
            self.stats.baseline_tokens_per_s = 1.0 / costs.plain_step()
            self.stats.checkpoint_steps, self.stats.restore_steps = costs.rollback_steps()
            self.stats.calibration_stale = costs.stale
        self.stats.healed_bytes = len(healed)
        self.text = TextStream(request.stops, request.min_indent, skip=healed)
        self.prompt_logprobs: list[TokenLogprob] = []  # once read, where Request.prompt_logprobs asks for them
        self.shown = False  # whether the answer has shown any text yet

    def steps(self) -> Iterator[Event | Pass]:
        """Prefill, then the answer's tokens as events; the last has token None, the remaining
        text and the final stats. Each pass of the target and of the draft model is handed out to
        be decoded (Engine.decode, where other runs' passes may join it) before the run goes on:
        Engine.events decodes it alone, a scheduler with the others'. A run cancelled (from another thread) stops
        at its next prefill chunk or round, with finish_reason "cancelled"."""
        stats, start = self.stats, perf_counter()
        self.sequence = self.sequences.hold(self.prompt)
        try:
            prefilled = yield from self._prefill()
            stats.prefill_s = perf_counter() - start
            if prefilled:
                yield from self._answer()
        finally:  # ended, or closed by its owner (a client gone, idle work interrupted)
            self.sequences.release(self.sequence)
        stats.repeated_tokens, stats.repeat_period = trailing_repeat(self.seq[len(self.prompt) :])
        yield Event(self.text.flush(), None, None, self.stats)

    def remembered(self) -> list[int]:
        """What a memory keeps of the run (memory.py): its prompt and answer as the target read and
        wrote them (its end of generation included, a hang-up's partial answer too); an editor's
        prompt, sent again at every keystroke, only as far back as a match is looked for."""
        answered = len(self.prompt) + self.stats.n_tokens + (self.stats.finish_reason == "stop")
        start = max(0, len(self.prompt) - DEPTH) if self.layout is not None else 0
        return self.seq[start:answered]

    def enter(self) -> None:
        """Before each pass: the models work on this run's sequence (see sequences.py)."""
        self.sequences.enter(self.sequence)

    def _prefill(self) -> Iterator[Pass]:
        """The prompt into the caches, a pass at a time (handed out); returns False where cancelled on the
        way. The target's cache holds all but the last token, which opens the first verify batch; it
        is read prefill_chunk tokens a pass, so that a client who left (an editor's user typing on)
        waits for one pass at most, and the next request finds what was read so far in the cache."""
        target, prompt, scored = self.target, self.prompt, self.request.prompt_logprobs
        self.sequences.enter(self.sequence)
        # scored, every prompt token's row is needed: none of them comes from the cache
        self.stats.n_prompt_cached = target.cache.cut(0) if scored else target.cache.sync(prompt, prompt=True)
        if scored:  # nothing comes before the first token to score it
            self.prompt_logprobs = [TokenLogprob(prompt[0], target.piece(prompt[0]), None)]
        waited = False  # for another run reading this prompt's start: once
        while True:
            if self._cancelled():
                return False
            self.enter()
            at = len(target.tokens)
            if at >= len(prompt) - 1:
                break
            if not (scored or waited) and (waited := (yield from self._waited(at))):  # copy what it read
                self.enter()
                self.stats.n_prompt_cached = target.cache.sync(prompt, prompt=True)
                continue
            chunk = prompt[at : min(at + self.prefill_chunk, len(prompt) - 1)]
            logits = (yield from self._pass(chunk, len(chunk) if scored else None)).logits
            if scored:  # the row of prompt[i] scores prompt[i + 1]
                following = prompt[at + 1 : at + len(chunk) + 1]
                self.prompt_logprobs += token_logprobs(logits, following, self.request.logprobs or 0, target.piece)
        self.sequences.read(self.sequence)
        room = min(target.n_ctx, self.limit - 1) - len(prompt)
        # the draft model's prefill (a streamed answer's, at its first draft)
        yield from self.controller.begin(prompt, room, self.prefill_chunk, streamed=self.request.streamed)
        return True

    def _waited(self, have: int) -> Iterator[Pass]:
        """Steps waited (passes of no tokens) while a run that began before this one reads more of
        this prompt than the cache's `have` tokens (Sequences.reading_ahead) and gets on with it (a
        run whose passes are not decoded, a library caller's, is waited for one step); returns
        whether it waited."""
        seen = None
        while (progress := self.sequences.reading_ahead(self.sequence, self.prompt, have)) not in (None, seen):
            seen = progress
            yield Pass(self.sequence, [], model=self.target)
            if self._cancelled():
                break
        return seen is not None

    def _pass(self, tokens: list[int], rows: int | None, parents: list[int] | None = None) -> Iterator[Pass]:
        """A pass of the target over `tokens` (the last of them a tree's nodes, where `parents`
        says: see Pass) in this run's sequence, handed out to be decoded;
        returns it decoded (its logits: see Model.eval), the models back on this run's sequence.
        Raises what stopped it (ContextFull, EdgespecError)."""
        decoded = Pass(self.sequence, tokens, rows, model=self.target, parents=parents)
        yield decoded
        self.enter()
        decoded.result()
        if (costs := self.controller.costs) is not None:  # the next round is priced with this batch
            costs.batch = Batch(self.sequence, decoded.beside)
        return decoded

    def _answer(self) -> Iterator[Event]:
        """The answer's tokens as events, until a stop (finish_reason set)."""
        target, stats, start = self.target, self.stats, perf_counter()
        if self.request.max_tokens == 0:  # the prompt was all there was to do
            stats.finish_reason = "length"
            return
        try:
            for new_tokens in self.rounds():
                if isinstance(new_tokens, Pass):
                    yield new_tokens
                    continue
                for new in new_tokens:
                    token = new.token
                    if target.is_eog(token):
                        stats.finish_reason = "stop"
                        break
                    stats.n_tokens, stats.decode_s = stats.n_tokens + 1, perf_counter() - start
                    if stats.n_tokens == 1:
                        stats.first_token_s = stats.prefill_s + stats.decode_s
                    piece = target.piece(token)
                    source = "draft" if new.from_draft else "target"
                    text = self.text.push(piece)
                    self.shown = self.shown or bool(text)
                    yield Event(text, token, source, stats, new.logprob)
                    stats.finish_reason = self._stop_after(piece)
                    if stats.finish_reason:
                        break
                if stats.finish_reason or self._cancelled():
                    break
        except ContextFull:
            stats.finish_reason = "context"

    def _stop_after(self, piece: bytes) -> str | None:
        """Why the answer ends after this token's `piece`, if it does."""
        request, stats = self.request, self.stats
        if self.text.stopped:
            stats.stop_string = self.text.stopped
            return "stop_string"
        if self.text.under_indented:
            return "indent"
        if request.line_deadline_s is not None and b"\n" in piece and stats.decode_s > request.line_deadline_s:
            return "deadline"
        return "length" if stats.n_tokens == request.max_tokens else None

    def _cancelled(self) -> bool:
        if self.cancelled is not None and self.cancelled.is_set():
            self.stats.finish_reason = "cancelled"
            return True
        return False

    def rounds(self) -> Iterator[list[NewToken] | Pass]:
        """Rounds of plan -> draft -> verify -> accept -> observe. Yields each round's verify pass
        (to be decoded, maybe beside other runs'), then its new tokens, 1..γ+1 of them. Under a
        constraint (a grammar, or token healing; in its state after seq, advanced here) the
        target's law at every row is the constrained one (p_g). Raises ContextFull."""
        target, controller, params, seq = self.target, self.controller, self.params, self.seq
        while True:
            self.enter()
            constraint = self.constraint
            if constraint is not None and constraint.done:  # a healed answer has written what it owed
                constraint = self.constraint = None
            if constraint is not None and constraint.finished():  # only an end may follow: the target would pick one
                yield [NewToken(target.eos, False, None)]
                return
            # drafts past the context or the budget are wasted
            room = min(target.n_ctx - len(seq), self.limit - len(seq) - 1)
            if self.request.again and self.known is not None and (known := self.known.ahead(seq, room)) is not None:
                yield self._known_round(known, constraint)
                continue
            clock = RoundClock()
            # the controller picks a drafter and γ (or none)
            # a streamed answer's first text waits for its round's end (see Controller.plan); a healed
            # prompt's answer shows none until it has written the healed text again
            plan = controller.plan(seq, room, constraint, first=self.request.streamed and not self.shown)
            clock.mark("draft")
            yield from controller.catch_up(plan, seq)
            clock.mark(None)  # (a prefill: not the round's time)
            draft, drafting = yield from _own_time(controller.draft(plan, seq, params, self.rng, constraint))
            clock.mark("draft", own=drafting)  # (other runs' steps may have come between its draft model's passes)
            self.enter()

            # a recurrent state cannot be cut back: keep a way back before a pass that may be rejected
            if draft.tokens:
                target.cache.checkpoint(len(draft.tokens) + 1)
            rereads = len(seq) - 1 - len(target.tokens)
            clock.mark("rollback")

            # ONE target forward over [last token, x_1..x_γ]: row i is p(. | seq, x_1..x_i); after a recurrent
            # target's rollback its kept tokens come first (the cache holds seq[:-1], or less: see below). A tree
            # of drafts: row i + 1 is p(. | seq, node i's branch down to it), every branch in the same pass
            tokens = seq[len(target.tokens) :] + draft.tokens
            target_pass = yield from self._pass(tokens, len(draft.tokens) + 1, draft.parents)
            clock.mark("verify", own=target_pass.seconds)  # its decode's time (other runs' steps between are theirs)
            logits = target_pass.logits
            kept, next_token = self._accept(draft, logits, constraint)
            n = len(kept)
            new = [draft.tokens[i] for i in kept] + [next_token]
            clock.mark("verify")
            # (read before the cut)
            drawn_from = logits if draft.parents is None else logits[[0, *(i + 1 for i in kept)]]
            logprobs = self._logprobs(drawn_from, new)
            if self.known is not None:
                self.known.record(len(self.prompt), seq, new, drawn_from)
            clock.mark(None)

            # drop the rejected drafts from the target's cache (the drafter trims its own); a recurrent state may
            # go back further, to its checkpoint: the kept tokens after it open the next pass, not one of their own
            if draft.parents is not None:
                target.cache.keep(kept)
            target.cache.cut(len(seq) + n)
            seq += new
            clock.mark("rollback")
            report = controller.observe(plan, draft, n, clock.timing(rereads, target_pass.beside), seq, kept)
            self.stats.record(report, clock.own)
            yield [
                NewToken(token, i < n, logprob) for i, (token, logprob) in enumerate(zip(new, logprobs, strict=True))
            ]

    def _accept(self, draft: Draft, logits: np.ndarray, constraint: Constraint | None) -> tuple[list[int], int]:
        """The draft's nodes the target keeps, by its rows `logits` after the sequence (row 0) and
        after each node, and the token after them; the constraint advanced through both."""
        answer = self.seq[len(self.prompt) :] if self.params.penalties.counts_tokens else []  # (a copy: only if read)
        rows = TargetRows(logits, self.params, self.target, constraint, draft.tokens, answer)
        if self.params.greedy:  # accept while x_i == argmax p_i; the next token is the target's argmax
            kept, next_token = verify_tree_greedy(draft.tokens, draft.parents, rows.argmax)
        else:  # accept x_i w.p. min(1, p_i(x)/q_i(x)); else resample norm(max(p_i - q_i, 0)); bonus from p_γ
            uniforms = position_uniforms(self.seed, len(self.seq), draft.depth + 1, 1 + draft.width)
            kept, next_token = verify_tree(draft.tokens, draft.parents, draft.q, rows.p, uniforms)
        rows.advance(len(kept), next_token)
        return kept, next_token

    def _known_round(self, known: Ahead, constraint: Constraint | None) -> list[NewToken]:
        """A round on rows an earlier answer to this prompt computed (known_rows.py): the path it took
        is verified as a draft (point masses) whose target rows are in hand, no pass; the target's
        cache reads the tokens taken at the next pass."""
        seq = self.seq
        kept, next_token = self._accept(Draft(known.tokens, None, source=Source.COPY), known.rows, constraint)
        new = known.tokens[: len(kept)] + [next_token]
        logprobs = self._logprobs(known.rows, new)
        seq += new
        self.controller.followed(seq)
        self.stats.known_tokens += len(new)
        return [NewToken(token, False, logprob) for token, logprob in zip(new, logprobs, strict=True)]

    def _logprobs(self, logits: np.ndarray, new: list[int]) -> list[TokenLogprob | None]:
        """The round's new tokens scored by the target's rows that drew them (row i: the i-th), if asked for."""
        if self.request.logprobs is None:
            return [None] * len(new)
        return token_logprobs(logits, new, self.request.logprobs, self.target.piece)


class TargetRows:
    """The target's law at each row of a verify pass, made only when verification gets
    there. Under a constraint, row i is the constrained law in the constraint's state after
    draft[:i]: the constraint walks along the draft as far as it is accepted, never past a
    rejection, so it has nothing to roll back (a chain's: trees are drafted without one). Under
    penalties (SamplingParams.penalties), row i's logits are penalised for the answer's tokens
    before it, draft[:i] included (a chain's: trees are not drafted under penalties)."""

    def __init__(
        self,
        logits: np.ndarray,
        params: SamplingParams,
        target: Model,
        constraint: Constraint | None,
        draft: list[int],
        answer: list[int],
    ) -> None:
        self.logits, self.params, self.target, self.constraint, self.draft = logits, params, target, constraint, draft
        self.answer = answer  # the answer's tokens before row 0
        self.walked = 0  # draft tokens the constraint has taken

    def p(self, i: int) -> Law:
        if self.constraint is None:
            return law(self._row(i), self.params, self.target)
        self._walk(i)
        return self.constraint.law(self._row(i), self.params, self.target)

    def argmax(self, i: int) -> int:
        if self.constraint is None:
            return int(np.argmax(self._row(i)))
        self._walk(i)
        return self.constraint.argmax(self._row(i))

    def _row(self, i: int) -> np.ndarray:
        penalties = self.params.penalties
        if not penalties.active:
            return self.logits[i]
        return penalties.apply(self.logits[i], self.answer + self.draft[:i])

    def advance(self, n_accepted: int, next_token: int) -> None:
        """Take the round's tokens into the constraint: the accepted draft, then the next token."""
        if self.constraint is not None:
            self._walk(n_accepted)
            self.constraint.accept(next_token)

    def _walk(self, i: int) -> None:
        while self.walked < i:
            self.constraint.accept(self.draft[self.walked])
            self.walked += 1


def _own_time(steps: Generator[Pass, None, T]) -> Generator[Pass, None, tuple[T, float]]:
    """steps' passes handed out; returns what it returns, and its own seconds: its work and its
    passes' decodes, not the other runs' steps between."""
    own, start = 0.0, perf_counter()
    try:
        while True:
            one = next(steps)
            own += perf_counter() - start
            yield one
            own += one.seconds
            start = perf_counter()
    except StopIteration as end:
        return end.value, own + perf_counter() - start
