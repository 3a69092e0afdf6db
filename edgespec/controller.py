"""Before each round, choose the drafter and draft length that maximise the
expected tokens per second, or no draft at all.

    rate(drafter, γ) = E[n](α, γ) / (draft_cost(γ) + V(γ+1) + R(γ, α)),  E[n] = (1 - α^(γ+1)) / (1 - α)
    rate(off)        = 1 / V(1)

V(k) is the measured cost of one target pass over k tokens (calibration.py), the
draft cost is γ draft-model steps (a copy costs nothing), R is what cutting back a
recurrent state costs (0 for attention alone; cost_curve.RollbackCost: a checkpoint,
and after a rejection a restore and the kept tokens again), and α is each
drafter's acceptance rate, learnt online in this request. Each kind of round's cost
is also checked against the seconds it really took (LiveCost): the curve is timed now
and then, the rounds' real rates are the truest cost there is, so a drafter whose
rounds run slower than planned loses its place within a few rounds. In auto mode a
draft model that could not pay even at α = MODEL_GATE_ALPHA is left out of the
request altogether (not even prefilled: on a CPU its prefill is a third of the
prompt's time). A copy's α (per length
of its alignment) is learnt from every token the target writes while a copy is
aligned, drafted or not, so it needs no exploring; the draft model's plans use a
draw from α's posterior (Thompson sampling), so it gets tried on little evidence
and is left off when it keeps losing. Old evidence decays toward the prior, so a
drafter switched off for losing is tried again later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .calibration import TARGET_SIZES, CostCurve
from .cost_curve import RollbackCost, expected_tokens
from .drafters import CopyDrafter, Draft, Drafter, GrammarDrafter
from .grammar import Grammar
from .modes import DraftMode, Source, check_mode
from .prompt_cache import common_prefix
from .sampling import SamplingParams
from .stats import RoundTiming

MODEL_PRIOR_ALPHA = 0.7
GRAMMAR_PRIOR_ALPHA = 0.9  # forced text is certain; only the target's split of it into tokens may differ
MODEL_GATE_ALPHA = 0.95  # auto mode runs the draft model only where it would pay at this α (a good pair's on code)
# A draft must promise this much more than none: a plan that wins by less wins on the error of
# its α estimate (measured, Qwen pair on chat and code writing: copies planned at 1.00-1.06x
# of no draft accepted 0.47 of their tokens, not the 0.7-0.85 estimated, and cost 2-5%)
MIN_GAIN = 0.05
LIVE_PRIOR_ROUNDS = 3.0  # pseudo-rounds at the planned cost behind each kind of round's measured cost
LIVE_CLIP = 2.0  # one round moves its kind's cost by at most this factor (a page fault, a burst of load)
# rounds running this much faster than the curves say, over this many rounds: the curves were
# measured on a busy machine (other load only ever adds time) and are measured again
STALE_RATIO, STALE_ROUNDS = 0.8, 8.0
COPY_MAX_PRIOR = 0.9999
COPY_BUCKETS = ((2, 4), (8, 16), (16, 32), (64, float("inf")))  # (key, evidence below)
PRIOR_WEIGHT = 6.0  # pseudo-observations behind the prior: draws stay near it until evidence comes
DECAY = 0.99  # per round; after ~70 rounds old evidence counts half
MAX_MODEL_GAMMA = 12
MAX_COPY_DRAFT = 64
SLOW_START = 2  # longest draft before any evidence; +4 per recently accepted token
HYBRID_MIN_MATCH = 5  # hybrid mode: a copy backed by this many agreeing tokens is confident enough to use
ALL = "all"  # the live cost of every kind of round together


@dataclass(frozen=True)
class ForcedText:
    """A grammar's forced draft, to be compared with what the target then wrote."""

    tokens: list[int]
    at: int  # the context's length when it was made

    def outcome(self, context: list[int]) -> tuple[int, int]:
        """(tokens the target wrote as drafted, tokens that tells about): the first
        disagreement is a rejection; a draft longer than what was written tells nothing past it."""
        written = context[self.at : self.at + len(self.tokens)]
        agreed = common_prefix(self.tokens, written, len(written))
        return agreed, agreed + (agreed < len(written))


@dataclass(frozen=True)
class CopyKey:
    """Copies are tracked by how many tokens back their alignment (1-3, 4-15, 16-31, 32+):
    a fresh short anchor fails far more often than a copy that has held for 30 tokens."""

    source: Source  # COPY or PREDICTION
    bucket: int  # the COPY_BUCKETS key its evidence falls in

    @classmethod
    def of(cls, source: Source, evidence: int) -> CopyKey:
        return cls(source, next(bucket for bucket, below in COPY_BUCKETS if evidence < below))

    def __str__(self) -> str:  # as Stats.alpha_by_source names it: "copy2", "prediction64", ...
        return f"{self.source}{self.bucket}"


AcceptanceKey = Source | CopyKey  # whose acceptance rate: MODEL, GRAMMAR, or a copy's CopyKey


def prior_alpha(key: AcceptanceKey) -> float:
    """Before any evidence: a draft model is usually right; a copy is the surer the
    longer its alignment has held (0.57 for a fresh anchor, 0.84, 0.96, then ~1)."""
    if isinstance(key, CopyKey):
        return min(COPY_MAX_PRIOR, 1 - 0.5 * 0.85 ** (key.bucket - 1))
    return {Source.MODEL: MODEL_PRIOR_ALPHA, Source.GRAMMAR: GRAMMAR_PRIOR_ALPHA}[key]


@dataclass
class Prediction:
    """What the plans chosen so far promised: expected tokens, and their cost in target steps."""

    tokens: float = 0.0
    steps: float = 0.0

    @property
    def speedup(self) -> float:
        return self.tokens / self.steps if self.steps > 0 else 1.0


@dataclass
class Acceptance:
    """Per-token acceptance rate α of one drafter: each round contributes its
    accepted tokens and at most one rejection (the geometric model's estimator)."""

    prior: float
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_WEIGHT * self.prior) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def sample(self, rng: np.random.Generator) -> float:
        """A draw from the Beta posterior of α (Thompson sampling): little evidence
        means wide draws, so an untried drafter is tried now and then, and one that
        keeps failing almost never."""
        return rng.beta(self.accepted + PRIOR_WEIGHT * self.prior, self.rejected + PRIOR_WEIGHT * (1 - self.prior))

    def observe(self, n_accepted: int, n_drafted: int) -> None:
        self.accepted += n_accepted
        self.rejected += n_accepted < n_drafted

    def decay(self) -> None:
        self.accepted *= DECAY
        self.rejected *= DECAY


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


@dataclass
class Plan:
    """A round's choice: what to draft and how much, and what that promised."""

    rate: float  # tokens per second it promises under this round's draw of α (what plans compete on)
    source: Source
    gamma: int
    draft: Draft | None = None  # a copy draft is made while planning (it is free)
    key: AcceptanceKey | None = None  # whose acceptance rate
    expected_rate: float | None = None  # under the posterior mean of α (default: rate)
    alpha: float = 1.0  # the posterior mean of α the plan was made with
    forced: ForcedText | None = None  # the grammar's forced text this round, drafted or not
    rng_state: dict | None = None  # the Thompson draws' generator after this plan's draw

    def __post_init__(self) -> None:
        if self.expected_rate is None:
            self.expected_rate = self.rate


NO_DRAFT = Plan(0.0, Source.OFF, 0)


def _draft_again(step: float):
    """What a draft model's kept tokens cost again after a restore: its next pass takes the
    k - 1 of them beside the token it had to evaluate anyway, at about a step each."""
    return lambda k: (k - 1) * step


class Controller:
    """Chooses, each round, what to draft (see the module docstring), and learns from the
    round: plan() has no side effects; draft() makes the plan's draft; observe() takes in
    everything the round taught (acceptance, live costs, where the copy is, forced text).

    mode: auto (any drafter or none, per round), model, copy, hybrid (a copy when
    one is confident, else the model), off. gamma: a fixed draft length,
    or None to choose it. With a fixed mode and a fixed gamma every round drafts
    exactly as told; as soon as either is auto, a round may also draft nothing."""

    def __init__(
        self,
        mode: DraftMode | str,
        gamma: int | None,
        verify_cost: CostCurve | None,
        draft_step_cost: CostCurve | None,
        model: Drafter | None,
        copy: CopyDrafter,
        forced: GrammarDrafter | None = None,
        verify_rollback: RollbackCost | None = None,
        draft_rollback: RollbackCost | None = None,
        seed: int = 0,
    ) -> None:
        """copy: this request's copy drafter; verify_rollback, draft_rollback: what cutting back
        the target's and the draft model's recurrent states costs (None: attention alone, a cut is free);
        seed: of the Thompson draws (fixed, so that runs repeat exactly)."""
        self.mode, self.gamma = check_mode(mode, has_model=model is not None), gamma
        self.adaptive = self.mode is DraftMode.AUTO or gamma is None
        self.V, self.draft_step = verify_cost, draft_step_cost
        self.verify_rollback, self.draft_rollback = verify_rollback, draft_rollback
        available = {Source.MODEL: model, Source.COPY: copy, Source.GRAMMAR: forced}
        # the drafters this controller may plan for: only those the mode allows and that exist
        self.drafters = {s: available[s] for s in self.mode.sources if available[s] is not None}
        if self.mode is DraftMode.AUTO and Source.MODEL in self.drafters and not self._model_can_pay(MODEL_GATE_ALPHA):
            del self.drafters[Source.MODEL]  # it would lose here whatever it drafts: not run, not prefilled
        self.acceptance: dict[AcceptanceKey, Acceptance] = {}
        self.live: dict[Source | str, LiveCost] = {}  # per kind of round (Plan.source) and ALL
        self.predicted = Prediction()
        self._rng = np.random.default_rng(seed)  # the Thompson draws

    def prefill(self, context: list[int], room: int | None = None) -> None:
        """Get the drafters ready to draft after `context`. room: the answer's tokens at most; in
        auto mode, a draft model whose prefill (the tokens its cache lacks) would cost more than it
        can save over that many tokens is left out of the request: a 20k-token agent prompt is
        minutes of a CPU's time for a draft model, and a short answer never earns them back."""
        model = self.drafters.get(Source.MODEL)
        if self.mode is DraftMode.AUTO and model is not None and room is not None:
            held = getattr(getattr(model, "model", None), "tokens", [])
            missing = len(context) - 1 - common_prefix(held, context, len(context) - 1)
            if missing * self._draft_prefill_cost() > room * self._model_saving(MODEL_GATE_ALPHA):
                del self.drafters[Source.MODEL]
        for drafter in self.drafters.values():
            drafter.prefill(context)

    def _draft_prefill_cost(self) -> float:
        """Seconds the draft model takes to read one prompt token: the target's batched pass,
        scaled by the two models' single steps (the draft model's curve is measured at 1-2 tokens);
        0 for a drafter of unknown cost (as in model_cost)."""
        if self.draft_step is None:
            return 0.0
        largest = max(TARGET_SIZES)
        return self.V(largest) / largest * self.draft_step(1) / self.V(1)

    def _model_saving(self, alpha: float) -> float:
        """Seconds per answer token the draft model saves at α (0: it never does)."""
        return max(0.0, self.V(1) - self._model_cost_per_token(alpha))

    def _model_cost_per_token(self, alpha: float) -> float:
        """Seconds per answer token with the draft model at its best γ at α."""
        gammas = range(1, MAX_MODEL_GAMMA + 1)
        return min(self.model_cost(g, alpha) / expected_tokens(alpha, g) for g in gammas)

    def _model_can_pay(self, alpha: float) -> bool:
        return self._model_cost_per_token(alpha) * (1 + MIN_GAIN) < self.V(1)

    def costs_look_stale(self) -> bool:
        """Whether this request's rounds ran far faster than the cost curves say (STALE_RATIO)."""
        seen = self.live.get(ALL)
        return seen is not None and seen.rounds >= STALE_ROUNDS and seen.ratio < STALE_RATIO

    def plain_step(self) -> float:
        """Seconds a round without a draft takes now: the calibrated step, as this request's
        rounds have really been running against their plan (LiveCost)."""
        return self.cost(Source.OFF, 0)

    def model_cost(self, gamma: int, alpha: float) -> float:
        step = self.draft_step(1) if self.draft_step else 0.0
        cost = gamma * step + self.verify_cost(gamma, alpha)
        if self.draft_rollback is not None:
            cost += self.draft_rollback.expected(gamma, alpha, _draft_again(step))
        return cost

    def verify_cost(self, gamma: int, alpha: float) -> float:
        """A verify pass over γ drafts and the token before them, with the rollback it may need."""
        if self.verify_rollback is None or gamma == 0:
            return self.V(gamma + 1)
        return self.V(gamma + 1) + self.verify_rollback.expected(gamma, alpha, self.V)

    def acceptance_of(self, key: AcceptanceKey) -> Acceptance:
        """The acceptance rate learnt for `key` (from its prior, if nothing yet)."""
        return self.acceptance.setdefault(key, Acceptance(prior_alpha(key)))

    def _acceptance(self, key: AcceptanceKey) -> Acceptance:
        """What is learnt for `key`, without keeping anything (for planning)."""
        return self.acceptance.get(key) or Acceptance(prior_alpha(key))

    def cost(self, source: Source, gamma: int, alpha: float = 1.0) -> float:
        """Expected seconds of a round whose drafts are accepted at rate alpha: a copy is free,
        a model draft is not; as its kind of round has really been running in this request (LiveCost)."""
        return self.planned_cost(source, gamma, alpha) * self._live(source).ratio_toward(self._live(ALL).ratio)

    def planned_cost(self, source: Source, gamma: int, alpha: float = 1.0) -> float:
        """A round's expected seconds by the cost curves alone."""
        return self.model_cost(gamma, alpha) if source is Source.MODEL else self.verify_cost(gamma, alpha)

    def round_cost(self, source: Source, gamma: int, accepted: int) -> float:
        """What a finished round should have cost by the curves, given what it kept."""
        step = self.draft_step(1) if source is Source.MODEL and self.draft_step else 0.0
        cost = gamma * step + self.V(gamma + 1)
        if self.verify_rollback is not None and gamma:
            cost += self.verify_rollback.of_round(gamma, accepted, self.V)
        if self.draft_rollback is not None and source is Source.MODEL and gamma:
            cost += self.draft_rollback.of_round(gamma, accepted, _draft_again(step))
        return cost

    def _live(self, kind: Source | str) -> LiveCost:
        return self.live.get(kind) or LiveCost()

    def _gammas(self, longest: int, cut_short: bool = False) -> list[int]:
        """Draft lengths worth planning: those whose verify pass has a size the cost curve
        knows (on a CPU, where V(k) has knees, the cheap sizes; without a curve, any), and
        a draft that was cut short (a copy ending there is worth verifying in one pass)."""
        if self.V is None:
            return list(range(1, longest + 1))
        return sorted({k - 1 for k in self.V.sizes(longest + 1) if k > 1} | ({longest} if cut_short else set()))

    def _best(self, source: Source, key: AcceptanceKey, gammas, evidence: int = 0, rng=None) -> Plan:
        """γ that the posterior mean of α says is best; the plan then competes with the
        others (and with no draft) at its rate under a posterior draw of α from `rng`
        (Thompson sampling), so a drafter with little evidence gets tried now and then."""
        acceptance = self._acceptance(key)
        # slow start: a long draft on little evidence costs a lot when it fails at once, so γ
        # may only grow with the tokens this drafter has had accepted lately (or, for a copy,
        # with the tokens its alignment has held for)
        gammas = [g for g in gammas if g <= SLOW_START + 4 * max(acceptance.accepted, evidence)] or [min(gammas)]
        alpha = acceptance.alpha
        expected, gamma = max((expected_tokens(alpha, g) / self.cost(source, g, alpha), g) for g in gammas)
        if rng is None:  # a copy needs no exploring: its evidence grows for free while the target agrees
            return Plan(expected, source, gamma, key=key, alpha=alpha)
        drawn = acceptance.sample(rng)
        rate = expected_tokens(drawn, gamma) / self.cost(source, gamma, drawn)
        return Plan(rate, source, gamma, key=key, expected_rate=expected, alpha=alpha)

    def _free_plan(self, draft: Draft, key: AcceptanceKey, evidence: int, cut_short: bool) -> Plan:
        """The plan for a free draft (a copy, forced text): as much of it as is worth verifying."""
        n = len(draft.tokens)
        gammas = [n] if self.gamma else self._gammas(n, cut_short)
        if self.adaptive:
            plan = self._best(draft.source, key, gammas, evidence)
        else:
            plan = Plan(1.0, draft.source, gammas[0], key=key)
        plan.draft = Draft(draft.tokens[: plan.gamma], None, source=draft.source)
        return plan

    def plan(self, context: list[int], room: int, grammar: Grammar | None = None) -> Plan:
        """The round's plan, learning nothing (observe() does): a copy or forced plan carries
        its draft already. Under a grammar (in its state after `context`), a copy is cut where
        the grammar forbids it (the rest would be rejected)."""
        if room <= 0 or self.mode is DraftMode.OFF:
            return NO_DRAFT
        fixed = self.gamma
        candidates = []
        if self.adaptive:
            off_rate = 1.0 / self.plain_step()
            candidates.append(Plan((1 + MIN_GAIN) * off_rate, Source.OFF, 0, expected_rate=off_rate))
        confident_copy = False
        if copy := self.drafters.get(Source.COPY):
            lookup = copy.draft(context, min(room, fixed or MAX_COPY_DRAFT))
            if grammar is not None:
                lookup.tokens = grammar.allowed_prefix(lookup.tokens)
            hybrid = self.mode is DraftMode.HYBRID
            confident_copy = bool(lookup.tokens) and (not hybrid or copy.evidence >= HYBRID_MIN_MATCH)
            if confident_copy:
                key = CopyKey.of(lookup.source, copy.evidence)
                candidates.append(self._free_plan(lookup, key, copy.evidence, len(lookup.tokens) < MAX_COPY_DRAFT))
        forced_text, rng_state = None, None  # forced text is free to make: its α is learnt every round, drafted or not
        if grammar is not None and (forced := self.drafters.get(Source.GRAMMAR)):
            text = forced.draft(context, min(room, fixed or MAX_COPY_DRAFT), grammar=grammar)
            if text.tokens:
                forced_text = ForcedText(text.tokens, len(context))
                candidates.append(self._free_plan(text, Source.GRAMMAR, len(text.tokens), True))
        # hybrid: the model only where the lookup has no confident match
        if Source.MODEL in self.drafters and not (self.mode is DraftMode.HYBRID and confident_copy):
            gammas = [min(fixed, room)] if fixed else self._gammas(min(MAX_MODEL_GAMMA, room), room < MAX_MODEL_GAMMA)
            if self.adaptive:  # the draw comes from a copy of the generator; observe() moves the real one on
                rng = np.random.Generator(type(self._rng.bit_generator)())
                rng.bit_generator.state = self._rng.bit_generator.state
                candidates.append(self._best(Source.MODEL, Source.MODEL, gammas, rng=rng))
                rng_state = rng.bit_generator.state
            else:
                candidates.append(Plan(1.0, Source.MODEL, gammas[0], key=Source.MODEL))
        if not candidates:
            return NO_DRAFT
        return replace(max(candidates, key=lambda p: p.rate), forced=forced_text, rng_state=rng_state)

    def draft(
        self,
        plan: Plan,
        context: list[int],
        params: SamplingParams,
        rng: np.random.Generator,
        grammar: Grammar | None = None,
    ) -> Draft:
        """The plan's draft (possibly empty: speculation off for the round); under `grammar`
        (in its state after `context`), one the grammar allows."""
        if plan.source is Source.OFF:
            return Draft([], None, source=Source.OFF)
        if plan.draft is not None:
            return plan.draft
        stop_below = ()
        if self.adaptive:
            # include draft token i+1 only while its expected yield, P(all accepted), beats
            # what its extra cost (one draft step + the verify batch growing) earns at this plan's rate
            step = self.draft_step(1) if self.draft_step else 0.0
            stop_below = [plan.rate * (step + self.V(i + 2) - self.V(i + 1)) for i in range(plan.gamma)]
        return self.drafters[plan.source].draft(context, plan.gamma, params, rng, stop_below, grammar=grammar)

    def observe(self, plan: Plan, draft: Draft, n_accepted: int, timing: RoundTiming, context: list[int]) -> None:
        """Learn from a finished round: `plan`'s `draft`, of which the target kept n_accepted,
        took `timing`; `context` is the sequence after it. Its acceptance, the real costs,
        the draws the plan used, and what the free drafters see in the new tokens."""
        if plan.rng_state is not None:
            self._rng.bit_generator.state = plan.rng_state
        if self.V is not None and plan.rate > 0:  # on the costs the plan was made with; in
            # steps, so the machine's drift is no part of the prediction (a round without a draft: 1 for 1)
            seconds = self.cost(plan.source, plan.gamma, plan.alpha)
            self.predicted.tokens += plan.expected_rate * seconds
            self.predicted.steps += seconds / self.cost(Source.OFF, 0)
        for learnt in (*self.acceptance.values(), *self.live.values()):
            learnt.decay()
        source = draft.source
        if draft.tokens and not source.free:  # free drafts learn from every token (below)
            self.acceptance_of(plan.key).observe(n_accepted, len(draft.tokens))
        if self.V is not None:
            planned = self.round_cost(source, len(draft.tokens), n_accepted)
            for kind in (source, ALL):
                self.live.setdefault(kind, LiveCost()).observe(timing.total, planned)
            self.V.observe(len(draft.tokens) + 1, timing.verify)
            if source is Source.MODEL and draft.tokens and self.draft_step is not None:
                self.draft_step.observe(1, timing.draft / len(draft.tokens))
        if copy := self.drafters.get(Source.COPY):
            # every token the target wrote while a copy was aligned says whether the copy was
            # right: α per evidence level is learnt from all of them, drafted or not
            for outcome in copy.follow(context):
                self.acceptance_of(CopyKey.of(outcome.source, outcome.evidence)).observe(outcome.matched, 1)
        if plan.forced is not None:
            self.acceptance_of(Source.GRAMMAR).observe(*plan.forced.outcome(context))

    def alphas(self) -> dict[str, float]:
        """The acceptance rate learnt per drafter (and per copy evidence level), for Stats."""
        return {str(key): round(a.alpha, 3) for key, a in self.acceptance.items()}
