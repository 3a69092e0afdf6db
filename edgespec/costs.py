"""What a round costs on this machine, and how a request's rounds really ran against it.

    V(k)             one target pass over k tokens (calibration.py measures it: a CostCurve)
    d                one draft-model step (the draft model's curve, at 1-2 tokens)
    R(γ, α)          cutting a recurrent state back (cost_curve.RollbackCost; 0 for attention alone)
    model round      γ d + V(γ+1) + R_target(γ, α) + R_draft(γ, α)
    free round       V(γ+1) + R_target(γ, α)          (a copy or forced text: no model runs)

Beside other requests (a server's), a round's pass is decoded with theirs: V(γ+1) becomes the
whole decode, V over each of the micro-batches llama.cpp splits it into (ubatches) times what
spreading a micro-batch over its sequences costs here (cost_curve.BatchSpread), and the
controller weighs the tokens of the whole batch (see controller.py): drafts that would slow
every neighbour down for less than they bring are left out, so that speculation stops by
itself where the batch is full. The same prices decide how several answers to one prompt
(n, n_cmpl) are made: side by side where a step of all of them costs much less than their steps
one after another (answers_side_by_side).

RoundCosts answers a request's controller from those curves, each kind of round's cost
checked against the seconds it really took (LiveCost): the curves are timed now and then,
the rounds' real times are the truest cost there is, so a kind of round running slower than
planned loses its place within a few rounds. Real rounds also move the curves themselves.
MachineCosts is the engine's: the curves per model (measured once, cached), and when to
time them again (the re-check schedule, run by Engine.upkeep when idle).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from time import perf_counter

from . import calibration
from .cost_curve import UNSPREAD, BatchSpread, CostCurve, RollbackCost, expected_tokens
from .drafters import Drafter
from .heads import Heads
from .model import Model
from .modes import Source
from .stats import RoundTiming

LIVE_PRIOR_ROUNDS = 3.0  # pseudo-rounds at the planned cost behind each kind of round's measured cost
LIVE_CLIP = 2.0  # one round moves its kind's cost by at most this factor (a page fault, a burst of load)
# rounds running this much faster than the curves say, over this many rounds: the curves were
# measured on a busy machine (other load only ever adds time) and are measured again
STALE_RATIO, STALE_ROUNDS = 0.8, 8.0
DECAY = 0.99  # per round; after ~70 rounds old evidence counts half (as the controller's acceptance)
ALL = "all"  # the live cost of every kind of round together
RECHECK_SHARE = 0.05  # at most this share of an engine's time goes to timing costs again
# answers to one prompt go side by side where a step of them all costs at most this share of their
# steps one after another: else one after another, each drafted from the one before (answers to one
# prompt are much alike), gains as much. Measured on a 2-core EPYC (Qwen pair, V(3) 0.85 of 3 steps):
# llama.vscode's n_cmpl 3 of 48 tokens each took 2.23 s one after another, 2.52 s side by side (as
# 3 requests), so the two break even near 0.75; from 0.6 down side by side clearly gains
SIDE_BY_SIDE_SHARE = 0.6


@dataclass(frozen=True)
class MicroBatch:
    """One of the micro-batches llama.cpp splits a decode into: its tokens, over how many sequences."""

    tokens: int
    sequences: int


def ubatches(passes: Sequence[tuple[int, int]]) -> list[MicroBatch]:
    """The micro-batches llama.cpp decodes passes of several sequences in ((sequence, tokens)
    each), where each sequence has cells of its own (its split_equal): each takes as many tokens
    from every sequence of a run of consecutive ones as the shortest of them has left."""
    left = dict(sorted(passes))
    split = []
    while left:
        run = [next(iter(left))]
        while run[-1] + 1 in left:
            run.append(run[-1] + 1)
        n = min(left[seq] for seq in run)
        split.append(MicroBatch(n * len(run), len(run)))
        for seq in run:
            left[seq] -= n
            if not left[seq]:
                del left[seq]
    return split


def answers_side_by_side(verify: CostCurve, count: int, spread: BatchSpread = UNSPREAD) -> bool:
    """Whether `count` answers to one prompt are best made side by side, a step of each decoded
    together (one micro-batch of a row per sequence: V(count), spread over count sequences),
    rather than one after another."""
    return verify(count) * spread(count) <= SIDE_BY_SIDE_SHARE * count * verify(1)


@dataclass(frozen=True)
class Batch:
    """Where a request's next pass is decoded: its sequence, and the other requests' passes
    ((sequence, tokens) each) decoded with its last one."""

    seq: int = 0
    beside: tuple[tuple[int, int], ...] = ()


@dataclass
class LiveCost:
    """How the seconds one kind of round really took compare with its plan: the
    geometric mean of real/planned over recent rounds (decaying like the acceptance
    evidence), shrunk by LIVE_PRIOR_ROUNDS toward a prior ratio (for a kind of round,
    that of all rounds: a kind not run yet is as slow as the machine is now, not as the
    curve says, or it would look cheaper than the kinds that have run)."""

    log_ratio: float = 0.0  # decayed sum of log(real / planned)
    rounds: float = 0.0  # decayed count

    @property
    def ratio(self) -> float:
        return self.ratio_toward(1.0)

    def ratio_toward(self, prior: float) -> float:
        return math.exp((self.log_ratio + LIVE_PRIOR_ROUNDS * math.log(prior)) / (self.rounds + LIVE_PRIOR_ROUNDS))

    def observe(self, seconds: float, planned: float) -> None:
        if seconds > 0 and planned > 0:
            self.log_ratio += min(max(math.log(seconds / planned), -math.log(LIVE_CLIP)), math.log(LIVE_CLIP))
            self.rounds += 1

    def decay(self) -> None:
        self.log_ratio *= DECAY
        self.rounds *= DECAY


def _draft_again(step: float):
    """What a draft model's kept tokens cost again after a restore: its next pass takes the
    k - 1 of them beside the token it had to evaluate anyway, at about a step each."""
    return lambda k: (k - 1) * step


class RoundCosts:
    """A request's costs: seconds of each kind of round (by the curves, and as this request's
    rounds have really run), learnt from every finished round (observe)."""

    def __init__(
        self,
        verify: CostCurve,
        draft_step: CostCurve | None = None,
        verify_rollback: RollbackCost | None = None,
        draft_rollback: RollbackCost | None = None,
        spread: BatchSpread = UNSPREAD,
        stale: str = "",
    ) -> None:
        """verify: V(k) of the target; draft_step: the draft model's curve (None: no draft model,
        or one of unknown cost, counted free); the rollbacks: what cutting the target's and the
        draft model's recurrent states back costs (None: attention alone, a cut is free);
        spread: what a target pass spread over several sequences costs beyond V; stale: why the
        curves could not be timed again when due (MachineCosts.renewal_failed; "": they were)."""
        self.stale = stale
        self._verify, self._draft = verify, draft_step
        self._verify_rollback, self._draft_rollback = verify_rollback, draft_rollback
        self._spread = spread
        self.live: dict[Source | str, LiveCost] = {}  # per kind of round (a Source) and ALL
        self.batch = Batch()  # what its next pass is decoded with (the run says, after each pass)

    # --- the curves ----------------------------------------------------------------
    def verify_pass(self, k: int) -> float:
        """V(k): one target pass over k tokens."""
        return self._verify(k)

    def draft_step(self) -> float:
        """One draft-model step (0: no draft model's cost known)."""
        return self.draft_pass(1)

    def draft_pass(self, k: int) -> float:
        """Seconds of one pass of the draft model over k tokens (a tree read again: Chain._grow)."""
        return self._draft(k) if self._draft is not None else 0.0

    def in_batch(self, k: int) -> float:
        """A pass over k tokens of this request, decoded with the passes beside it: the whole decode,
        each micro-batch V(its tokens) times what spreading them over its sequences costs."""
        if not self.batch.beside:
            return self._verify(k)
        split = ubatches((*self.batch.beside, (self.batch.seq, k)))
        return sum(self._verify(part.tokens) * self._spread(part.sequences) for part in split)

    @property
    def tokens_beside(self) -> int:
        """Tokens the other passes of the batch bring a step (one each, at least)."""
        return len(self.batch.beside)

    def in_steps(self, seconds: float) -> float:
        """`seconds` in target steps (V(1))."""
        return seconds / self._verify(1)

    def rollback_steps(self) -> tuple[float, float]:
        """(checkpoint, restore) of the target's recurrent state in target steps; (0, 0) for attention alone."""
        rollback = self._verify_rollback
        return (self.in_steps(rollback.checkpoint_s), self.in_steps(rollback.restore_s)) if rollback else (0.0, 0.0)

    def pass_sizes(self, longest: int) -> list[int]:
        """Verify pass sizes worth planning, up to `longest`: on a CPU, where V(k) has knees, the cheap sizes."""
        return self._verify.sizes(longest)

    def longest_pass(self, seconds: float, longest: int) -> int:
        """The most tokens (of pass_sizes up to `longest`) a pass reads within `seconds` (at least 1)."""
        return max((k for k in self.pass_sizes(longest) if self.verify_pass(k) <= seconds), default=1)

    # --- a round's cost ------------------------------------------------------------
    def model_round(self, gamma: int, alpha: float) -> float:
        """A draft-model round of γ drafts accepted at rate α, by the curves."""
        step = self.draft_step()
        cost = gamma * step + self.verify_round(gamma, alpha)
        if self._draft_rollback is not None:
            cost += self._draft_rollback.expected(gamma, alpha, _draft_again(step))
        return cost

    def verify_round(self, gamma: int, alpha: float) -> float:
        """A verify pass over γ drafts and the token before them, with the rollback it may need."""
        if self._verify_rollback is None or gamma == 0:
            return self.in_batch(gamma + 1)
        return self.in_batch(gamma + 1) + self._verify_rollback.expected(gamma, alpha, self._verify)

    def planned(self, source: Source, gamma: int, alpha: float = 1.0) -> float:
        """A round's expected seconds by the curves alone (a copy is free, a model draft is not)."""
        return self.model_round(gamma, alpha) if source is Source.MODEL else self.verify_round(gamma, alpha)

    def expected(self, source: Source, gamma: int, alpha: float = 1.0) -> float:
        """A round's expected seconds, as its kind of round has really been running in this request."""
        return self.planned(source, gamma, alpha) * self._live(source).ratio_toward(self._live(ALL).ratio)

    def plain_step(self) -> float:
        """Seconds a round without a draft takes now: the calibrated step, as this request's
        rounds have really been running against their plan."""
        return self.expected(Source.OFF, 0)

    def of_round(self, source: Source, gamma: int, accepted: int, steps: int | None = None) -> float:
        """What a finished round should have cost by the curves, given what it kept (steps: the
        draft model's, default γ: see observe)."""
        step = self.draft_step() if source is Source.MODEL else 0.0
        cost = (gamma if steps is None else steps) * step + self.in_batch(gamma + 1)
        if self._verify_rollback is not None and gamma:
            cost += self._verify_rollback.of_round(gamma, accepted, self._verify)
        if self._draft_rollback is not None and source is Source.MODEL and gamma:
            cost += self._draft_rollback.of_round(gamma, accepted, _draft_again(step))
        return cost

    # --- the draft model's worth ---------------------------------------------------------
    def model_per_token(self, alpha: float, gammas) -> float:
        """Seconds per answer token with the draft model at its best γ (of `gammas`) at α."""
        return min(self.model_round(g, alpha) / expected_tokens(alpha, g) for g in gammas)

    def draft_prefill_per_token(self) -> float:
        """Seconds the draft model takes to read one prompt token: the target's batched pass,
        scaled by the two models' single steps (the draft model's curve is measured at 1-2 tokens);
        0 for a draft model of unknown cost (counted free, as in model_round)."""
        if self._draft is None:
            return 0.0
        largest = max(calibration.TARGET_SIZES)
        return self._verify(largest) / largest * self._draft(1) / self._verify(1)

    # --- learning from real rounds --------------------------------------------------------
    def observe(
        self, source: Source, drafted: int, accepted: int, timing: RoundTiming, steps: int | None = None
    ) -> None:
        """A finished round: `drafted` tokens from `source`, `accepted` kept, took `timing`; steps:
        the draft model's (a tree's siblings come free with its chain's: its depth, and the passes that
        grew branches below them), default drafted."""
        steps = drafted if steps is None else steps
        for live in self.live.values():
            live.decay()
        planned = self.of_round(source, drafted, accepted, steps)
        for kind in (source, ALL):
            self.live.setdefault(kind, LiveCost()).observe(timing.total, planned)
        if not timing.beside:  # a pass alone times V(k) itself
            self._verify.observe(drafted + 1 + timing.rereads, timing.verify)
        if source is Source.MODEL and steps and self._draft is not None:
            self._draft.observe(1, timing.draft / steps)

    def look_stale(self) -> bool:
        """Whether this request's rounds ran far faster than the curves say (STALE_RATIO)."""
        seen = self.live.get(ALL)
        return seen is not None and seen.rounds >= STALE_ROUNDS and seen.ratio < STALE_RATIO

    def _live(self, kind: Source | str) -> LiveCost:
        return self.live.get(kind) or LiveCost()


class Recheck(Enum):
    """The cost re-check an engine has due (MachineCosts.upkeep runs it)."""

    NONE = 0
    DUE = 1  # the points measured long ago, within the time budget (RECHECK_SHARE)
    ALL = 2  # every point: the last answer's rounds ran far faster than the curves say (timed on a busy machine)


class MachineCosts:
    """An engine's costs: each model's cost curve and rollback cost on this machine (cached,
    else measured at first use), the RoundCosts of each request made from them, and the
    re-check they have due."""

    def __init__(self, timer: calibration.Timer = calibration.TIMER) -> None:
        """timer: what times the models' passes (calibration.Timer; tests give their own)."""
        self.timer = timer
        self._curves: dict[tuple, CostCurve] = {}
        self._rollbacks: dict[Model, RollbackCost | None] = {}
        self._spreads: dict[Model, BatchSpread] = {}
        self._heads: dict[Heads, CostCurve] = {}
        # seconds of answering since the last re-check, less what re-checks cost / RECHECK_SHARE:
        # many short answers must not each pay for one
        self._credit = 0.0
        self.recheck = Recheck.NONE  # due, for upkeep()
        self.renewal_failed: str | None = None  # why the last upkeep failed (it is tried again)

    def curve(self, model: Model, sizes=calibration.TARGET_SIZES) -> CostCurve:
        """V(k) of `model` on this machine: cached, else measured now (once)."""
        if (model, sizes) not in self._curves:
            self._curves[model, sizes] = calibration.load_or_measure(model, sizes, self.timer)
        return self._curves[model, sizes]

    def rollback(self, model: Model) -> RollbackCost | None:
        """What cutting `model`'s recurrent state back costs here (None: attention alone): cached, else measured now."""
        if model not in self._rollbacks:
            self._rollbacks[model] = calibration.load_or_measure_rollback(model)
        return self._rollbacks[model]

    def spread(self, model: Model) -> BatchSpread:
        """What a pass of `model` spread over several sequences costs here: cached, else measured now."""
        if model not in self._spreads:
            self._spreads[model] = calibration.load_or_measure_spread(model, self.timer)
        return self._spreads[model]

    def draft_step(self, drafter: Drafter | None) -> CostCurve | None:
        """What a step of `drafter` costs here (None: it runs no model, as the copies): the draft
        model's curve, or the target's MTP layers' step; cached, else measured now."""
        if drafter is not None and drafter.heads is not None:
            if drafter.heads not in self._heads:
                self._heads[drafter.heads] = calibration.load_or_measure_heads(drafter.heads)
            return self._heads[drafter.heads]
        if drafter is None or drafter.model is None:  # (a drafter of the user's may run none)
            return None
        return self.curve(drafter.model, calibration.DRAFT_SIZES)

    def of_request(self, target: Model, drafter: Drafter | None = None) -> RoundCosts:
        """A request's costs with the engine's drafter (None: copies alone), on this engine's
        curves (rounds move them for the requests after)."""
        verify, spread, rollback = self.curve(target), self.spread(target), self.rollback(target)
        draft_model = drafter.model if drafter is not None else None  # (the heads' cache is simply cut)
        draft_rollback = self.rollback(draft_model) if draft_model is not None else None
        stale = self.renewal_failed or ""
        return RoundCosts(verify, self.draft_step(drafter), rollback, draft_rollback, spread, stale)

    def answered(self, seconds: float, costs: RoundCosts | None) -> None:
        """An answer took `seconds` with these `costs` (None: none planned): schedule a re-check.
        Timed on a busy machine: all of it again, whatever the budget (once: then it is right);
        else what was measured long ago, within the budget (a due re-check never undoes one of all)."""
        self._credit += seconds
        if costs is None:
            return
        if costs.look_stale():
            for curve in self._curves.values():
                curve.mark_stale()
            self.recheck = Recheck.ALL
        elif self._credit >= 0 and self.recheck is Recheck.NONE:
            self.recheck = Recheck.DUE

    def upkeep(self) -> None:
        """Time again one point of each curve the last answers found stale (see calibration.recheck),
        if any: a request that comes meanwhile waits for one point's passes at most. Where all were
        stale, recheck stays ALL until each point has been timed again (or a pass finds no room)."""
        curves = [(model, curve) for (model, _), curve in self._curves.items()]
        recheck, self.recheck = self.recheck, Recheck.NONE
        if recheck is Recheck.NONE:
            return
        try:
            start = perf_counter()
            timed = calibration.recheck(curves, timer=self.timer)
        except Exception as e:  # kept due, and said in every answer's stats until a re-check works
            self.recheck, self.renewal_failed = recheck, f"{type(e).__name__}: {e}".splitlines()[0][:200]
            raise
        if recheck is Recheck.ALL:
            if timed and any(curve.due() is not None for _, curve in curves):
                self.recheck = Recheck.ALL
        else:
            self._credit -= (perf_counter() - start) / RECHECK_SHARE
        self.renewal_failed = None

    def save(self) -> None:
        """Keep what real rounds taught about the curves, for the next engine on this machine."""
        for (model, sizes), curve in self._curves.items():
            calibration.save(model, sizes, curve)
        self._curves.clear()
