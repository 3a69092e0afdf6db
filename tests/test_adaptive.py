"""Adaptive speculation: n-gram drafter, controller decisions, calibration cache."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_greedy_match
from scipy import stats as scipy_stats

from edgespec import Draft, Engine, SamplingParams, calibration
from edgespec.calibration import CostCurve
from edgespec.controller import Controller, Plan, expected_tokens
from edgespec.drafters import NgramDrafter
from edgespec.sampling import distribution

# --- n-gram drafter ------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_match():
    drafter = NgramDrafter(sizes=(4, 2))
    context = [1, 2, 3, 4, 5, 6, 9, 3, 4, 7, 8, 1, 2, 3, 4]
    draft = drafter.draft(context, 10)
    assert draft.tokens == [5, 6, 9, 3, 4, 7, 8, 1, 2, 3] and draft.q is None  # the 4-gram wins over "3 4 -> 7"
    assert drafter.last_match == 4 and draft.source == "ngram"


def test_ngram_prefers_the_most_recent_occurrence_and_respects_n():
    drafter = NgramDrafter(sizes=(2,))
    context = [5, 6, 1, 5, 6, 2, 5, 6]
    assert drafter.draft(context, 1).tokens == [2]
    assert drafter.draft(context, 3).tokens == [2, 5, 6]


def test_ngram_never_matches_the_context_suffix_itself_and_starts_over_on_new_context():
    drafter = NgramDrafter(sizes=(3,))
    assert drafter.draft([1, 2, 3], 5).tokens == []
    assert drafter.draft([1, 2, 3, 9, 1, 2, 3], 5).tokens == [9, 1, 2, 3]
    assert drafter.draft([7, 7, 7, 8, 1, 2, 3], 5).tokens == []  # the old conversation's n-grams are gone
    assert drafter.draft([7, 7, 7, 8, 1, 2, 3, 7, 7, 7], 5).tokens == [8, 1, 2, 3, 7]


class StubModelDrafter:
    """Stands in for a draft model in controller tests: proposes a fixed token."""

    def __init__(self):
        self.calls = []

    def prefill(self, context):
        pass

    def draft(self, context, n, params, rng, stop_below=()):
        self.calls.append((n, tuple(stop_below)))
        return Draft([42] * n, None, source="model")


GREEDY = SamplingParams(temperature=0)
RNG = np.random.default_rng(0)


def test_hybrid_uses_a_confident_ngram_match_else_the_model():
    model = StubModelDrafter()
    controller = Controller("hybrid", 4, None, None, model, NgramDrafter())
    repeated = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13, 14]
    draft = controller.propose(repeated, 10, GREEDY, RNG)
    assert draft.source == "ngram" and draft.tokens == [15, 16, 17, 10]
    short = [10, 11, 12, 99, 10, 11, 12]  # only a 3-token match: not confident
    assert controller.propose(short, 10, GREEDY, RNG).source == "model" and model.calls[-1][0] == 4


# --- controller on synthetic cost curves --------------------------------------

CPU = CostCurve({1: 1.0, 2: 1.46, 3: 1.85, 4: 1.63, 5: 2.18, 6: 2.46, 7: 2.97, 8: 2.98, 16: 3.68})  # issue 3's figures
GPU = CostCurve({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3, 32: 1.8})
DRAFT = CostCurve({1: 0.3, 2: 0.33})


def adaptive(verify=GPU, draft=DRAFT):
    return Controller("auto", None, verify, draft, StubModelDrafter(), NgramDrafter())


def feed(controller, accepted, drafted, rounds=1):
    """Rounds as if the controller had drafted `drafted` model tokens (0: a round without a draft),
    each timed exactly as the cost curves predict."""
    for _ in range(rounds):
        controller.last = Plan(0.0, "model" if drafted else "off", drafted, key="model" if drafted else "")
        draft = Draft([0] * drafted, None, source=controller.last.source)
        controller.observe(draft, accepted, DRAFT(1) * drafted, controller.V(drafted + 1))


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.9, 0.97])
@pytest.mark.parametrize("curve", [CPU, GPU], ids=["cpu", "gpu"])
def test_controller_picks_the_gamma_the_formula_says(alpha, curve):
    controller = adaptive(curve)
    controller._acceptance("model").accepted = alpha * 1e6  # evidence overwhelming the prior
    controller._acceptance("model").rejected = (1 - alpha) * 1e6
    rates = {g: expected_tokens(alpha, g) / (g * DRAFT(1) + curve(g + 1)) for g in range(1, 13)}
    best = max(rates, key=rates.get)
    plan = controller.plan([1, 2, 3], 100)  # no n-gram match in this context
    if rates[best] > 1 / curve(1):
        assert (plan.source, plan.gamma) == ("model", best)
    else:
        assert plan.source == "off"


def test_controller_turns_off_when_alpha_is_low_and_comes_back_when_it_rises():
    controller = adaptive()
    assert controller.plan([1, 2, 3], 100).source == "model"  # the prior says a draft model pays on a GPU
    feed(controller, accepted=0, drafted=4, rounds=20)  # every draft rejected at once
    assert controller._acceptance("model").alpha < 0.2
    assert controller.plan([1, 2, 3], 100).source == "off"
    off_rounds = 0
    while controller.plan([1, 2, 3], 100).source == "off":  # old evidence fades: a probe comes
        feed(controller, accepted=0, drafted=0)
        off_rounds += 1
        assert off_rounds < 200
    assert off_rounds > 5  # ... but not at once
    feed(controller, accepted=4, drafted=4, rounds=30)  # the probe found α high again
    assert controller.plan([1, 2, 3], 100).source == "model"
    assert controller._acceptance("model").alpha > 0.8


def test_model_draft_gets_stop_thresholds_from_the_cost_model():
    controller = adaptive(CPU, CostCurve({1: 0.2, 2: 0.25}))
    controller._acceptance("model").accepted = 1e6  # α ≈ 1
    draft = controller.propose([1, 2, 3], 100, GREEDY, RNG)
    n, stop_below = controller.drafters["model"].calls[-1]
    assert draft.source == "model" and len(stop_below) == n
    plan = controller.last
    assert stop_below[0] == pytest.approx(plan.rate * (0.2 + CPU(2) - CPU(1)))


def test_fixed_mode_and_gamma_always_draft():
    controller = Controller("model", 3, None, None, StubModelDrafter(), NgramDrafter())
    draft = controller.propose([1, 2, 3], 100, GREEDY, RNG)
    assert draft.tokens == [42, 42, 42]
    assert controller.propose([1, 2, 3], 2, GREEDY, RNG).tokens == [42, 42]  # never past the room left


def test_cost_curve_interpolates_extrapolates_and_learns():
    curve = CostCurve({1: 1.0, 2: 2.0, 4: 3.0, 8: 5.0})
    assert curve(3) == pytest.approx(2.5)
    assert curve(16) == pytest.approx(9.0)  # the last slope continues
    curve.observe(3, 100.0)  # an outlier is clipped to 2x and weighted; the curve keeps its shape
    assert curve(3) == pytest.approx(2.5 * 1.1) and curve(8) == pytest.approx(5.0 * 1.1)


# --- calibration cache --------------------------------------------------------


def test_calibration_is_cached_and_reused(tmp_path, monkeypatch, smollm2):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    first = calibration.load_or_measure(smollm2, (1, 2, 4))
    assert (tmp_path / "calibration.json").is_file()
    assert first(1) > 0 and first(4) > first(1)

    def no_measuring(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration, "measure", no_measuring)
    again = calibration.load_or_measure(smollm2, (1, 2, 4))
    np.testing.assert_allclose(again.table, first.table)
    # an engine refines the curve from real rounds and saves it when it closes
    engine = Engine(smollm2, None, draft_mode="auto", owned=[])
    monkeypatch.setattr(calibration, "TARGET_SIZES", (1, 2, 4))
    curve = engine.cost_curve(smollm2, (1, 2, 4))
    curve.observe(1, curve(1) * 1.5)
    engine.close()
    assert calibration.load_or_measure(smollm2, (1, 2, 4))(1) == pytest.approx(curve(1))


# --- exactness with the n-gram drafter (real SmolLM2) -------------------------

REPEATING = "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape."


def test_ngram_greedy_equals_no_draft(smollm2):
    engine = Engine(smollm2, None, gamma=8, draft_mode="ngram")
    baseline = engine.generate(REPEATING, speculative=False, temperature=0, max_tokens=60)
    spec = engine.generate(REPEATING, temperature=0, max_tokens=60)
    assert spec.stats.rounds_by_source.get("ngram", 0) > 0 and spec.stats.accepted > 0
    assert_greedy_match("ngram", smollm2, engine.prompt_tokens(REPEATING), baseline.tokens, spec.tokens)


def test_ngram_first_token_distribution_matches_target(smollm2):
    """A point-mass draft (accept x w.p. p(x), else sample p without x) is exact:
    chi-square of the first token over 2000 runs against the target's probabilities."""
    engine, runs = Engine(smollm2, None, gamma=2, draft_mode="ngram"), 2000
    prompt = "one two three four five six. one two three four five six. one two three four"
    params = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    tokens = engine.prompt_tokens(prompt, raw=True)
    assert len(engine.ngram.draft(tokens, 2).tokens) == 2  # the round drafts from the repetition
    smollm2.eval(tokens[smollm2.sync(tokens) : -1])
    logits = smollm2.eval([tokens[-1]] * 3, all_logits=True)[0]
    p = distribution(logits, SamplingParams(**params))
    rng = np.random.default_rng(5)
    counts = np.zeros(len(p))
    sources = set()
    for _ in range(runs):
        events = engine.stream(prompt, raw=True, max_tokens=4, seed=int(rng.integers(2**32)), **params)
        first = next(events)
        events.close()
        counts[first.token] += 1
        sources.add(first.source)
    assert sources == {"draft", "target"}
    expected = p * runs
    big = expected >= 5
    observed_bins = np.r_[counts[big], counts[~big].sum()]
    expected_bins = np.r_[expected[big], expected[~big].sum()]
    assert scipy_stats.chisquare(observed_bins, expected_bins).pvalue > 0.01


def test_auto_without_a_draft_model_never_plans_one():
    """The prior says a draft model pays on these costs; with none loaded, no plan may name it."""
    controller = Controller("auto", None, GPU, None, None, NgramDrafter())
    assert "model" not in controller.drafters
    for context in ([1, 2, 3], [1, 2, 3, 4, 1, 2, 3]):
        for _ in range(50):
            draft = controller.propose(context, 100, GREEDY, RNG)
            assert draft.source in ("off", "ngram")
