"""Before each round, choose the drafter and draft length that maximise the
expected tokens per second, or no draft at all.

    rate(drafter, γ) = E[n](α, γ) / (draft_cost(γ) + V(γ+1) + R(γ, α)),  E[n] = (1 - α^(γ+1)) / (1 - α)
    rate(off)        = 1 / V(1)

Beside other requests' passes (a server's batch: b of them), V(γ+1) is the whole decode with
them in it and the rate is the batch's, (E[n] + b) / seconds: a draft has to pay for the time
it adds to every neighbour's step.

The costs are the request's RoundCosts (costs.py): V(k), one target pass over k tokens,
the draft cost, γ draft-model steps (a copy costs nothing), R, what cutting back a
recurrent state costs (0 for attention alone), each kind of round as it has really been
running in this request. α is each drafter's acceptance rate, learnt online in this
request. In auto mode a draft model that could not pay even at α = MODEL_GATE_ALPHA is
left out of the request altogether (not even prefilled: on a CPU its prefill is a third
of the prompt's time). A copy's α (per length of its alignment) is learnt from every
token the target writes while a copy is aligned, drafted or not, so it needs no
exploring; the draft model's plans use a draw from α's posterior (Thompson sampling), so
it gets tried on little evidence and is left off when it keeps losing. Old evidence
decays toward the prior, so a drafter switched off for losing is tried again later.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from time import perf_counter

import numpy as np

from .cost_curve import expected_tokens
from .costs import DECAY, RoundCosts
from .drafters import Branching, CopyDrafter, Draft, Drafter, GrammarDrafter
from .drafters.base import MAX_SIBLINGS
from .drafters.copy import Alternative, branched
from .drafters.recall import MemoryDrafter
from .modes import DraftMode, Gamma, Source, adaptive
from .passes import Pass
from .prompt_cache import common_prefix
from .sampling import Constraint, SamplingParams
from .stats import RoundReport, RoundTiming

MODEL_PRIOR_ALPHA = 0.7
GRAMMAR_PRIOR_ALPHA = 0.9  # forced text is certain; only the target's split of it into tokens may differ
MODEL_GATE_ALPHA = 0.95  # auto mode runs the draft model only where it would pay at this α (a good pair's on code)
# A draft must promise this much more than none: a plan that wins by less wins on the error of
# its α estimate (measured, Qwen pair on chat and code writing: copies planned at 1.00-1.06x
# of no draft accepted 0.47 of their tokens, not the 0.7-0.85 estimated, and cost 2-5%)
MIN_GAIN = 0.05
COPY_MAX_PRIOR = 0.9999
COPY_BUCKETS = ((2, 4), (8, 16), (16, 32), (64, float("inf")))  # (key, evidence below)
PRIOR_WEIGHT = 6.0  # pseudo-observations behind the prior: draws stay near it until evidence comes
MAX_MODEL_GAMMA = 12
MAX_COPY_DRAFT = 64
# a tree's node less likely to be taken than this is left out, even where the curve says one more
# token in the pass is free (V flat from k to k + 1): it would cost its Python and swell the stats
MIN_NODE_CHANCE = 0.01
RANKS = range(1, MAX_SIBLINGS + 1)  # a sibling's (see SiblingKey)
SIBLING_PRIOR = 2.0  # of chance: a rank's trust stays near 1 until its siblings' outcomes outweigh this
SLOW_START = 2  # longest draft before any evidence; +4 per recently accepted token
HYBRID_MIN_MATCH = 5  # hybrid mode: a copy backed by this many agreeing tokens is confident enough to use
# an answer's first token comes at its first round's end: that round may take at most this much more than a
# plain step (an editor's suggestion and a chat's first word wait for it; llama.vscode's first token came in
# 187 ms with a first round that drafted, 90 ms without, 2-core AMX Xeon)
FIRST_TOKEN_SLACK = 0.25


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
    a fresh short anchor fails far more often than a copy that has held for 30 tokens; the
    memory's drafts by how long the context's end they were found after."""

    source: Source  # COPY, PREDICTION or MEMORY
    bucket: int  # the COPY_BUCKETS key its evidence falls in

    @classmethod
    def of(cls, source: Source, evidence: int) -> CopyKey:
        return cls(source, next(bucket for bucket, below in COPY_BUCKETS if evidence < below))

    def __str__(self) -> str:  # as Stats.alpha_by_source names it: "copy2", "prediction64", ...
        return f"{self.source}{self.bucket}"


AcceptanceKey = Source | CopyKey  # whose acceptance rate: MODEL, GRAMMAR, or a copy's CopyKey


@dataclass(frozen=True)
class SiblingKey:
    """A drafter's siblings of one rank in a tree (1: its next likeliest token after the chain's;
    a copy's: its likeliest alternative after the copied text)."""

    source: Source  # MODEL, HEADS, COPY or PREDICTION
    rank: int

    def __str__(self) -> str:  # as Stats.alpha_by_source names their share taken: "model-sibling1", ...
        return f"{self.source}-sibling{self.rank}"


@dataclass
class SiblingTrust:
    """How the target took one rank's siblings where it reached their parent: `taken` of the
    `reached`, against the chances the drafter gave them (summed: `predicted`)."""

    taken: float = 0.0
    predicted: float = 0.0
    reached: float = 0.0

    @property
    def trust(self) -> float:
        """What the drafter's chances for this rank are to be multiplied by (1: as judged)."""
        return (self.taken + SIBLING_PRIOR) / (self.predicted + SIBLING_PRIOR)

    @property
    def share(self) -> float:
        """Of the siblings reached, the share taken."""
        return self.taken / self.reached if self.reached else 0.0

    def observe(self, taken: bool, chance: float) -> None:
        self.taken += taken
        self.predicted += chance
        self.reached += 1

    def decay(self) -> None:
        self.taken *= DECAY
        self.predicted *= DECAY
        self.reached *= DECAY


def prior_alpha(key: AcceptanceKey) -> float:
    """Before any evidence: a draft model is usually right; a copy is the surer the
    longer its alignment has held (0.57 for a fresh anchor, 0.84, 0.96, then ~1)."""
    if isinstance(key, CopyKey):
        return min(COPY_MAX_PRIOR, 1 - 0.5 * 0.85 ** (key.bucket - 1))
    return {Source.MODEL: MODEL_PRIOR_ALPHA, Source.HEADS: MODEL_PRIOR_ALPHA, Source.GRAMMAR: GRAMMAR_PRIOR_ALPHA}[key]


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
    recall_s: float = 0.0  # the memory's lookup while planning (see Stats.recall_s)
    rng_state: dict | None = None  # the Thompson draws' generator after this plan's draw
    round_s: float = 0.0  # the round's expected seconds (planned by cost: adaptive), its first token's wait

    def __post_init__(self) -> None:
        self.source = Source(self.source)  # (as Draft's: given as a string too)
        if self.expected_rate is None:
            self.expected_rate = self.rate


NO_DRAFT = Plan(0.0, Source.OFF, 0)


@dataclass(frozen=True)
class Drafters:
    """A request's drafters: its own copy drafter (and memory drafter, where the engine has a
    memory), and the engine's draft model and grammar drafters, if any."""

    copy: CopyDrafter
    model: Drafter | None = None
    grammar: GrammarDrafter | None = None
    memory: MemoryDrafter | None = None


class Controller:
    """Chooses, each round, what to draft (see the module docstring), and learns from the
    round: plan() has no side effects; draft() makes the plan's draft (begin() and draft() hand
    out the draft model's passes, see model.decoded_alone); observe() takes in
    everything the round taught (acceptance, live costs, where the copy is, forced text).

    mode: auto (any drafter or none, per round), model, copy, hybrid (a copy when one is
    confident, else the model), off. gamma: a fixed draft length, or one chosen per round.
    With a fixed mode and a fixed gamma every round drafts exactly as told; as soon as either
    is auto (modes.adaptive), a round may also draft nothing, planned on `costs`."""

    def __init__(
        self,
        mode: DraftMode,
        gamma: Gamma,
        costs: RoundCosts | None,
        drafters: Drafters,
        seed: int = 0,
        *,
        trees: bool = False,
    ) -> None:
        """costs: the request's (needed where rounds are planned by cost, else unused); seed: of
        the Thompson draws (fixed, so that runs repeat exactly); trees: the target verifies a
        tree of drafts in one pass (Model.can_branch), so a planned round's drafter may branch
        where it is unsure and the costs say a sibling pays (see draft())."""
        self.mode, self.gamma, self.costs, self.trees = mode, gamma, costs, trees
        self.adaptive = adaptive(mode, gamma)
        available = {
            Source.MODEL: drafters.model,
            Source.COPY: drafters.copy,
            Source.GRAMMAR: drafters.grammar,
            Source.MEMORY: drafters.memory,
        }
        # the drafters this controller may plan for: only those the mode allows and that exist
        self.drafters = {s: available[s] for s in self.mode.sources if available[s] is not None}
        # whose acceptance the engine's drafter learns: the draft model's, or the target's heads' (a
        # drafter of the user's may not say: a model's)
        self.model_key = drafters.model.source if drafters.model is not None else Source.MODEL
        if self.mode is DraftMode.AUTO and Source.MODEL in self.drafters and not self._model_can_pay(MODEL_GATE_ALPHA):
            del self.drafters[Source.MODEL]  # it would lose here whatever it drafts: not run, not prefilled
        self.model_prefill: int | None = None  # the draft model's prefill, put off to its first draft: its chunk
        self.acceptance: dict[AcceptanceKey, Acceptance] = {}
        self.siblings: dict[SiblingKey, SiblingTrust] = {}  # a tree's siblings, per drafter and rank
        self.predicted = Prediction()
        self._rng = np.random.default_rng(seed)  # the Thompson draws

    def begin(
        self, prompt: list[int], room: int | None = None, chunk: int | None = None, *, streamed: bool = False
    ) -> Generator[Pass, None, None]:
        """Get the drafters ready to draft after `prompt`, the draft model's passes handed out
        (`chunk` tokens at most each; model.decoded_alone decodes them as they come). room: the
        answer's tokens at most; in auto mode, a draft model whose prefill (the tokens its cache
        lacks) would cost more than it can save over that many tokens is left out of the request:
        a 20k-token agent prompt is minutes of a CPU's time for a draft model, and a short answer
        never earns them back. streamed: a streamed answer's first text waits for no draft
        model's prefill (where rounds are planned: see plan()); it is read before the model's
        first draft instead."""
        model = self.drafters.get(Source.MODEL)
        if self.mode is DraftMode.AUTO and model is not None and room is not None:
            held = model.model.cache.shares(prompt) if model.model is not None else 0
            missing = len(prompt) - 1 - held
            if missing * self.costs.draft_prefill_per_token() > room * self._model_saving(MODEL_GATE_ALPHA):
                del self.drafters[Source.MODEL]
        for source, drafter in self.drafters.items():
            if source is Source.MODEL and drafter.model is not None and streamed and self.adaptive:
                self.model_prefill = chunk or len(prompt)
                continue
            yield from drafter.begin_steps(prompt, chunk)

    def _model_per_token(self, alpha: float) -> float:
        """Seconds per answer token with the draft model at its best γ at α."""
        return self.costs.model_per_token(alpha, range(1, MAX_MODEL_GAMMA + 1))

    def _model_saving(self, alpha: float) -> float:
        """Seconds per answer token the draft model saves at α (0: it never does)."""
        return max(0.0, self.costs.verify_pass(1) - self._model_per_token(alpha))

    def _model_can_pay(self, alpha: float) -> bool:
        return self._model_per_token(alpha) * (1 + MIN_GAIN) < self.costs.verify_pass(1)

    def acceptance_of(self, key: AcceptanceKey) -> Acceptance:
        """The acceptance rate learnt for `key` (from its prior, if nothing yet)."""
        return self.acceptance.setdefault(key, Acceptance(prior_alpha(key)))

    def _acceptance(self, key: AcceptanceKey) -> Acceptance:
        """What is learnt for `key`, without keeping anything (for planning)."""
        return self.acceptance.get(key) or Acceptance(prior_alpha(key))

    def _gammas(self, longest: int, cut_short: bool = False) -> list[int]:
        """Draft lengths worth planning: those whose verify pass has a size the cost curve
        knows (on a CPU, where V(k) has knees, the cheap sizes), and a draft that was cut
        short (a copy ending there is worth verifying in one pass)."""
        sizes = self.costs.pass_sizes(longest + 1)
        return sorted({k - 1 for k in sizes if k > 1} | ({longest} if cut_short else set()))

    def _best(
        self, source: Source, key: AcceptanceKey, gammas, evidence: int = 0, rng=None, within: float = np.inf
    ) -> Plan:
        """γ that the posterior mean of α says is best, of those whose round takes `within` seconds
        at most (the first round's); the plan then competes with the others (and with no draft)
        at its rate under a posterior draw of α from `rng` (Thompson sampling), so a drafter with
        little evidence gets tried now and then."""
        acceptance, costs = self._acceptance(key), self.costs
        alpha = acceptance.alpha
        # slow start: a long draft on little evidence costs a lot when it fails at once, so γ
        # may only grow with the tokens this drafter has had accepted lately (or, for a copy,
        # with the tokens its alignment has held for)
        gammas = [g for g in gammas if g <= SLOW_START + 4 * max(acceptance.accepted, evidence)] or [min(gammas)]
        gammas = [g for g in gammas if costs.expected(source, g, alpha) <= within] or [min(gammas)]

        def batch_rate(a: float, g: int) -> float:  # the batch's tokens per second (see the module docstring)
            return (expected_tokens(a, g) + costs.tokens_beside) / costs.expected(source, g, a)

        best, gamma = max((batch_rate(alpha, g), g) for g in gammas)
        seconds = costs.expected(source, gamma, alpha)
        expected = expected_tokens(alpha, gamma) / seconds  # this request's own
        rate = best if rng is None else batch_rate(acceptance.sample(rng), gamma)  # (a copy needs no exploring:
        # its evidence grows for free while the target agrees)
        return Plan(rate, source, gamma, key=key, expected_rate=expected, alpha=alpha, round_s=seconds)

    def _free_plan(
        self,
        draft: Draft,
        key: AcceptanceKey,
        evidence: int,
        cut_short: bool,
        alternatives: list[Alternative] = (),
        within: float = np.inf,
    ) -> Plan:
        """The plan for a free draft (a copy, forced text): as much of it as is worth verifying
        (in `within` seconds, see _best); with the alternatives (other places' text, where trees
        are verified), a tree where its branches pay, planned at the tree's rate."""
        n = len(draft.tokens)
        if self.adaptive:
            gammas = [n] if self.gamma.fixed else self._gammas(n, cut_short)
            plan = self._best(draft.source, key, gammas, evidence, within=within)
        else:  # as told; of two copies (the context's, the prediction's), the one of higher α
            plan = Plan(self._acceptance(key).alpha, draft.source, n, key=key)
        plan.draft = Draft(draft.tokens[: plan.gamma], None, source=draft.source)
        if alternatives:
            tree, gain = branched(plan.draft, alternatives, plan.alpha, self._branching(plan, draft.source))
            if tree.parents is not None:  # E[n] grows by each node's chance, the pass by its tokens
                costs, gamma, alpha = self.costs, plan.gamma, plan.alpha
                seconds = costs.expected(plan.source, gamma, alpha) + costs.in_batch(len(tree.tokens) + 1)
                seconds -= costs.in_batch(gamma + 1)
                plan.rate = (expected_tokens(alpha, gamma) + gain + costs.tokens_beside) / seconds
                plan.expected_rate = (expected_tokens(alpha, gamma) + gain) / seconds
                plan.draft, plan.round_s = tree, seconds
        return plan

    def plan(self, context: list[int], room: int, grammar: Constraint | None = None, *, first: bool = False) -> Plan:
        """The round's plan, learning nothing (observe() does): a copy or forced plan carries
        its draft already. Under a constraint (a grammar, or token healing; in its state after
        `context`), a copy is cut where it is forbidden (the rest would be rejected). first: a
        streamed answer's first round, whose end its first token waits for: planned by cost, it may take
        at most FIRST_TOKEN_SLACK more than a plain step (on a CPU, a short free draft at most;
        on a GPU, where a pass of a few tokens costs one, a draft model's too)."""
        if room <= 0 or self.mode is DraftMode.OFF:
            return NO_DRAFT
        fixed = self.gamma.fixed
        candidates, within = [], np.inf  # within: the longest round this one may be (the first's)
        if self.adaptive:
            step = self.costs.plain_step()
            within = (1 + FIRST_TOKEN_SLACK) * step if first else np.inf
            off_rate = (1 + self.costs.tokens_beside) / step
            candidates.append(Plan((1 + MIN_GAIN) * off_rate, Source.OFF, 0, expected_rate=1.0 / step, round_s=step))
        longest = min(room, fixed or MAX_COPY_DRAFT)
        branching = self.trees and self.adaptive and grammar is None  # (a tree is planned by its costs)
        copies = []  # (draft, evidence, alternatives): the context's and the prediction's, the memory's
        if copy := self.drafters.get(Source.COPY):
            alternatives = copy.alternatives(longest) if branching else []
            copies += [(lookup.draft, lookup.evidence, alternatives) for lookup in copy.lookups(longest)]
        recall_s = 0.0
        if memory := self.drafters.get(Source.MEMORY):
            start = perf_counter()
            if recalled := memory.recall(context, longest):
                copies.append((recalled.draft, recalled.evidence, recalled.alternatives if branching else []))
            recall_s = perf_counter() - start
        confident_copy = False
        for draft, evidence, alternatives in copies:  # each on its own α
            if grammar is not None:
                draft.tokens = grammar.allowed_prefix(draft.tokens)
            if draft.tokens and (self.mode is not DraftMode.HYBRID or evidence >= HYBRID_MIN_MATCH):
                confident_copy = True
                key = CopyKey.of(draft.source, evidence)
                cut_short = len(draft.tokens) < MAX_COPY_DRAFT
                candidates.append(self._free_plan(draft, key, evidence, cut_short, alternatives, within))
        forced_text, rng_state = None, None  # forced text is free to make: its α is learnt every round, drafted or not
        if grammar is not None and (forced := self.drafters.get(Source.GRAMMAR)):
            text = forced.draft(context, min(room, fixed or MAX_COPY_DRAFT), grammar=grammar)
            if text.tokens:
                forced_text = ForcedText(text.tokens, len(context))
                candidates.append(self._free_plan(text, Source.GRAMMAR, len(text.tokens), True, within=within))
        # hybrid: the model only where the lookup has no confident match
        # a first round does not wait for the draft model's prefill (begin: streamed)
        behind = first and self.model_prefill is not None
        if Source.MODEL in self.drafters and not (self.mode is DraftMode.HYBRID and confident_copy) and not behind:
            if not self.adaptive:
                candidates.append(Plan(1.0, Source.MODEL, min(fixed, room), key=self.model_key))
            else:  # the draw comes from a copy of the generator; observe() moves the real one on
                longest = min(MAX_MODEL_GAMMA, room)
                gammas = [min(fixed, room)] if fixed else self._gammas(longest, room < MAX_MODEL_GAMMA)
                rng = np.random.Generator(type(self._rng.bit_generator)())
                rng.bit_generator.state = self._rng.bit_generator.state
                candidates.append(self._best(Source.MODEL, self.model_key, gammas, rng=rng, within=within))
                rng_state = rng.bit_generator.state
        candidates = [p for p in candidates if p.round_s <= within]  # (a drafter's shortest, or a tree, may not fit)
        if not candidates:
            return replace(NO_DRAFT, recall_s=recall_s)
        best = max(candidates, key=lambda p: p.rate)
        return replace(best, forced=forced_text, rng_state=rng_state, recall_s=recall_s)

    def _branching(self, plan: Plan, source: Source, pass_cost: Callable[[int], float] | None = None) -> Branching:
        """What `plan`'s tree is shaped by: one more token in a pass of k costs what `plan` would make
        in that time (a node is worth verifying where its chance of being taken beats it, and at
        least MIN_NODE_CHANCE); `source`'s siblings are trusted per rank as learnt."""
        verify = self.costs.in_batch
        trust = [self.siblings.get(SiblingKey(source, rank), SiblingTrust()).trust for rank in RANKS]
        return Branching(lambda k: max(plan.rate * (verify(k + 1) - verify(k)), MIN_NODE_CHANCE), trust, pass_cost)

    def catch_up(self, plan: Plan, context: list[int]) -> Generator[Pass, None, None]:
        """Before the plan's draft: the draft model's prefill that begin() put off, where the plan
        drafts with it (its passes handed out as begin's; no part of the round's time)."""
        if plan.source is Source.MODEL and self.model_prefill is not None:
            chunk, self.model_prefill = self.model_prefill, None
            yield from self.drafters[Source.MODEL].begin_steps(context, chunk)

    def draft(
        self,
        plan: Plan,
        context: list[int],
        params: SamplingParams,
        rng: np.random.Generator,
        grammar: Constraint | None = None,
    ) -> Generator[Pass, None, Draft]:
        """The plan's draft (possibly empty: speculation off for the round), the draft model's
        passes handed out (as begin's); under a constraint `grammar` (in its state after `context`), one it
        allows."""
        if plan.source is Source.OFF:
            return Draft([], None, source=Source.OFF)
        if plan.draft is not None:
            return plan.draft
        drafter = self.drafters[plan.source]
        stop_below, tree = (), {}
        if self.adaptive:
            # include draft token i+1 only while its expected yield, P(all accepted), beats
            # what its extra cost (one draft step + the verify batch growing) earns at this plan's rate
            step, verify = self.costs.draft_step(), self.costs.in_batch
            stop_below = [plan.rate * (step + verify(i + 2) - verify(i + 1)) for i in range(plan.gamma)]
            if self.trees and grammar is None and drafter.branches:
                # the shape from the machine: a sibling is verified where its chance of being the
                # target's token beats what one more token in the pass costs at this rate (where V
                # is steep, a CPU's, that is a large part of a step: the chain stays a chain)
                draft_pass = self.costs.draft_pass
                tree = {"branching": self._branching(plan, self.model_key, lambda k: plan.rate * draft_pass(k))}
        return (yield from drafter.draft_steps(context, plan.gamma, params, rng, stop_below, grammar, **tree))

    def followed(self, context: list[int]) -> None:
        """The answer went on without a round of the controller's (rows known: Run._known_round):
        the drafters see its new tokens, `context` being the sequence now."""
        for drafter in self.drafters.values():
            drafter.accept(context)

    def observe(
        self,
        plan: Plan,
        draft: Draft,
        n_accepted: int,
        timing: RoundTiming,
        context: list[int],
        path: list[int] | None = None,
    ) -> RoundReport:
        """Learn from a finished round: `plan`'s `draft`, of which the target kept n_accepted
        (a tree's: the nodes of `path`, root first), took `timing`; `context` is the sequence
        after it. Its acceptance (a tree's siblings' per rank), the real costs, the draws the
        plan used, and what the drafters see in the new tokens. Returns the round's report (for Stats)."""
        costs, source = self.costs, draft.source
        if plan.rng_state is not None:
            self._rng.bit_generator.state = plan.rng_state
        if self.adaptive and plan.rate > 0:  # on the costs the plan was made with; in
            # steps, so the machine's drift is no part of the prediction (a round without a draft: 1 for 1)
            seconds = costs.expected(plan.source, plan.gamma, plan.alpha)
            self.predicted.tokens += plan.expected_rate * seconds
            self.predicted.steps += seconds / costs.plain_step()
        for learnt in [*self.acceptance.values(), *self.siblings.values()]:
            learnt.decay()
        if draft.chances is not None and path is not None:
            self._observe_siblings(draft, path)
        if draft.tokens and not source.free:  # free drafts learn from every token (below)
            self.acceptance_of(plan.key).observe(n_accepted, draft.depth)  # (a tree's: along its chain)
        if self.adaptive:  # (by the plan's source: the heads are priced in the draft model's place)
            costs.observe(plan.source, len(draft.tokens), n_accepted, timing, draft.depth + draft.grown)
        for drafter in self.drafters.values():
            drafter.accept(context)
        for free in (self.drafters.get(Source.COPY), self.drafters.get(Source.MEMORY)):
            # every token the target wrote while a copy was aligned (after a recall) says whether
            # it was right: α per evidence level is learnt from all of them, drafted or not
            for outcome in free.outcomes() if free is not None else ():
                self.acceptance_of(CopyKey.of(outcome.source, outcome.evidence)).observe(outcome.matched, 1)
        if plan.forced is not None:
            self.acceptance_of(Source.GRAMMAR).observe(*plan.forced.outcome(context))
        return RoundReport(
            source,
            len(draft.tokens),
            n_accepted,
            timing,
            {str(key): round(a.alpha, 3) for key, a in self.acceptance.items()}
            | {str(key): round(s.share, 3) for key, s in self.siblings.items()},
            self.predicted.speedup,
            costs.plain_step() if self.adaptive else 0.0,
            tree=draft.parents is not None,
            recall_s=plan.recall_s,
        )

    def _observe_siblings(self, draft: Draft, path: list[int]) -> None:
        """Each sibling whose parent the target reached (the context, or a node of `path`):
        taken or not, against the chance its drafter gave it, under its rank."""
        reached, taken = {-1, *path}, set(path)
        children: dict[int, int] = {}  # per parent, its children so far (the first: the chain's)
        for node, parent in enumerate(draft.parents):
            rank = children[parent] = children.get(parent, -1) + 1
            if rank and parent in reached:
                trust = self.siblings.setdefault(SiblingKey(draft.source, rank), SiblingTrust())
                trust.observe(node in taken, draft.chances[node])
