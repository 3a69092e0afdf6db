"""Before each round, choose the drafter and draft length that maximise the
expected tokens per second, or no draft at all.

    rate(drafter, γ) = E[n](α, γ) / (draft_cost(γ) + V(γ+1)),  E[n] = (1 - α^(γ+1)) / (1 - α)
    rate(off)        = 1 / V(1)

V(k) is the measured cost of one target pass over k tokens (calibration.py), the
draft cost is γ draft-model steps (an n-gram lookup costs nothing) and α is each
drafter's acceptance rate, learnt online in this request: each plan uses a draw
from α's posterior (Thompson sampling), so a drafter with little evidence gets
tried and one that keeps losing is left off. Old evidence decays toward the
prior, so a drafter switched off for losing is tried again later.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .calibration import CostCurve
from .drafters import Draft, Drafter, NgramDrafter
from .errors import EdgespecError
from .sampling import SamplingParams

MODES = ("auto", "model", "ngram", "hybrid", "off")
# the drafters each mode may draw on; a controller keeps only those that exist, so a plan
# for a missing drafter cannot be made (auto without a draft model: n-gram or nothing)
MODE_SOURCES = {
    "auto": ("ngram", "model"),
    "model": ("model",),
    "ngram": ("ngram",),
    "hybrid": ("ngram", "model"),
    "off": (),
}
MODEL_PRIOR_ALPHA = 0.7
PRIOR_WEIGHT = 6.0  # pseudo-observations behind the prior: draws stay near it until evidence comes
DECAY = 0.99  # per round; after ~70 rounds old evidence counts half
MAX_MODEL_GAMMA = 12
MAX_NGRAM_DRAFT = 64
SLOW_START = 2  # longest draft before any evidence; +4 per recently accepted token
HYBRID_MIN_MATCH = 5  # hybrid mode: an n-gram match this long is confident enough to use


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[tokens/round] = (1 - α^(γ+1)) / (1 - α): accepted drafts plus the one the target adds."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def check_mode(mode: str, *, has_model: bool) -> None:
    if mode not in MODES:
        raise EdgespecError(f"unknown draft mode '{mode}'; use one of {', '.join(MODES)}")
    if mode in ("model", "hybrid") and not has_model:
        raise EdgespecError(f"draft mode '{mode}' needs a draft model; give a pair or --draft, or use ngram")


def prior_alpha(key: str) -> float:
    """Before any evidence: a draft model is usually right; an n-gram match is the
    surer the longer it is (0.5 for 3 tokens, 0.87 for 16)."""
    if key == "model":
        return MODEL_PRIOR_ALPHA
    return 1 - 0.5 * 0.9 ** (int(key.removeprefix("ngram")) - 3)


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
class Plan:
    rate: float  # tokens per second it promises under this round's draw of α (what plans compete on)
    source: str  # "off", "model" or "ngram"
    gamma: int
    draft: Draft | None = None  # an n-gram draft is made while planning (it is free)
    key: str = ""  # whose acceptance rate: "model", or "ngram<match length>"
    expected_rate: float | None = None  # under the posterior mean of α (default: rate)

    def __post_init__(self) -> None:
        if self.expected_rate is None:
            self.expected_rate = self.rate


class Controller:
    """Chooses, each round, what to draft (see the module docstring).

    mode: auto (any drafter or none, per round), model, ngram, hybrid (n-gram when
    it has a confident match, else the model), off. gamma: a fixed draft length,
    or None to choose it. With a fixed mode and a fixed gamma every round drafts
    exactly as told; as soon as either is auto, a round may also draft nothing."""

    def __init__(
        self,
        mode: str,
        gamma: int | None,
        verify_cost: CostCurve | None,
        draft_step_cost: CostCurve | None,
        model: Drafter | None,
        ngram: NgramDrafter,
    ) -> None:
        check_mode(mode, has_model=model is not None)
        self.mode, self.gamma = mode, gamma
        self.adaptive = mode == "auto" or gamma is None
        self.V, self.draft_step = verify_cost, draft_step_cost
        available = {"model": model, "ngram": ngram}
        # the drafters this controller may plan for: only those the mode allows and that exist
        self.drafters = {s: available[s] for s in MODE_SOURCES[mode] if available[s] is not None}
        self.acceptance: dict[str, Acceptance] = {}  # per "model" / "ngram<match length>"
        self.last: Plan = Plan(0.0, "off", 0)
        self._predicted = [0.0, 0.0]  # expected tokens and seconds of the plans chosen so far
        self._rng = np.random.default_rng(0)  # Thompson draws; seeded so runs repeat exactly

    def prefill(self, context: list[int]) -> None:
        if "ngram" in self.drafters:
            self.drafters["ngram"].prefill(context)
        # in auto mode a draft model that cannot pay even at α = 1 is never run, so not prefilled
        if "model" in self.drafters and (self.mode != "auto" or self._model_can_pay()):
            self.drafters["model"].prefill(context)

    def _model_can_pay(self) -> bool:
        return any((g + 1) / self.model_cost(g) > self.off_rate() for g in range(1, MAX_MODEL_GAMMA + 1))

    def off_rate(self) -> float:
        return 1.0 / self.V(1)

    def model_cost(self, gamma: int) -> float:
        step = self.draft_step(1) if self.draft_step else 0.0
        return gamma * step + self.V(gamma + 1)

    def _acceptance(self, key: str) -> Acceptance:
        if key not in self.acceptance:
            self.acceptance[key] = Acceptance(prior_alpha(key))
        return self.acceptance[key]

    def cost(self, source: str, gamma: int) -> float:
        """Expected seconds of a round: an n-gram lookup is free, a model draft is not."""
        return self.model_cost(gamma) if source == "model" else self.V(gamma + 1)

    def _best(self, source: str, key: str, gammas) -> Plan:
        """γ chosen under a posterior draw of α (Thompson sampling); expected_rate
        is the same plan's rate under the posterior mean, for the stats."""
        acceptance = self._acceptance(key)
        # slow start: a long draft on little evidence costs a lot when it fails at once,
        # so γ may only grow with the tokens this drafter has had accepted lately
        gammas = [g for g in gammas if g <= SLOW_START + 4 * acceptance.accepted] or [min(gammas)]
        draw = acceptance.sample(self._rng)
        rate, gamma = max((expected_tokens(draw, g) / self.cost(source, g), g) for g in gammas)
        expected = expected_tokens(acceptance.alpha, gamma) / self.cost(source, gamma)
        return Plan(rate, source, gamma, key=key, expected_rate=expected)

    def plan(self, context: list[int], room: int) -> Plan:
        """The round's plan; an n-gram plan carries its draft already."""
        if room <= 0 or self.mode == "off":
            return Plan(0.0, "off", 0)
        fixed = self.gamma
        candidates = [Plan(self.off_rate(), "off", 0)] if self.adaptive else []
        confident_lookup = False
        if ngram := self.drafters.get("ngram"):
            lookup = ngram.draft(context, min(room, fixed or MAX_NGRAM_DRAFT))
            confident_lookup = bool(lookup.tokens) and (self.mode != "hybrid" or ngram.last_match >= HYBRID_MIN_MATCH)
            if confident_lookup:
                gammas = [len(lookup.tokens)] if fixed else range(1, len(lookup.tokens) + 1)
                key = f"ngram{ngram.last_match}"
                plan = self._best("ngram", key, gammas) if self.adaptive else Plan(1.0, "ngram", gammas[0], key=key)
                plan.draft = Draft(lookup.tokens[: plan.gamma], None, source="ngram")
                candidates.append(plan)
        # hybrid: the model only where the lookup has no confident match
        if "model" in self.drafters and not (self.mode == "hybrid" and confident_lookup):
            gammas = [min(fixed, room)] if fixed else range(1, min(MAX_MODEL_GAMMA, room) + 1)
            plan = self._best("model", "model", gammas) if self.adaptive else Plan(1.0, "model", gammas[0], key="model")
            candidates.append(plan)
        return max(candidates, key=lambda p: p.rate) if candidates else Plan(0.0, "off", 0)

    def propose(self, context: list[int], room: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """This round's draft (possibly empty: speculation off for the round)."""
        plan = self.last = self.plan(context, room)
        if plan.source == "off":
            return Draft([], None, source="off")
        if plan.draft is not None:
            return plan.draft
        stop_below = ()
        if self.adaptive:
            # include draft token i+1 only while its expected yield, P(all accepted), beats
            # what its extra cost (one draft step + the verify batch growing) earns at this plan's rate
            step = self.draft_step(1) if self.draft_step else 0.0
            stop_below = [plan.rate * (step + self.V(i + 2) - self.V(i + 1)) for i in range(plan.gamma)]
        return self.drafters[plan.source].draft(context, plan.gamma, params, rng, stop_below)

    def observe(self, draft: Draft, n_accepted: int, draft_s: float, verify_s: float) -> None:
        """Learn from a finished round: acceptance and the real costs."""
        for acceptance in self.acceptance.values():
            acceptance.decay()
        if draft.tokens:
            self._acceptance(self.last.key).observe(n_accepted, len(draft.tokens))
        if self.V is not None:
            self.V.observe(len(draft.tokens) + 1, verify_s)
            if draft.source == "model" and draft.tokens and self.draft_step is not None:
                self.draft_step.observe(1, draft_s / len(draft.tokens))
            if self.last.rate > 0:
                seconds = self.cost(self.last.source, self.last.gamma)
                self._predicted[0] += self.last.expected_rate * seconds
                self._predicted[1] += seconds

    def report(self, stats, draft: Draft) -> None:
        """Write what was chosen, and why, into the generation's Stats."""
        stats.rounds_by_source[draft.source] = stats.rounds_by_source.get(draft.source, 0) + 1
        stats.alpha_by_source = {source: round(a.alpha, 3) for source, a in self.acceptance.items()}
        stats.last_source, stats.last_gamma = draft.source, len(draft.tokens)
        if self._predicted[1] > 0:
            stats.predicted_speedup = self._predicted[0] / self._predicted[1] / self.off_rate()
