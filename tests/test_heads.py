"""The target's own multi-token-prediction heads as a drafter (issue 48, part 3), on tiny
random-weight GLM-4.5-shaped GGUFs with an MTP block (tiny_models.write_tiny_mtp): found in the
file, drafted with through a second llama.cpp context on the target's weights, exact (greedy:
Llama's answer token for token; sampled: the target's law), and left out by auto mode where
they do not pay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FixedCurve, GpuCosts
from reference import assert_first_token_law, assert_greedy_as_llama
from test_cli import run
from tiny_models import write_tiny, write_tiny_mtp

import edgespec
from edgespec import calibration
from edgespec.controller import MODEL_PRIOR_ALPHA
from edgespec.errors import EdgespecError
from edgespec.heads import has_heads
from edgespec.hidden_states import HiddenStates
from edgespec.model import Model
from edgespec.pairing import HEADS, find_draft
from edgespec.passes import Pass

pytestmark = pytest.mark.slow  # models written with the gguf package

PROMPT = "The quick brown fox jumps over the lazy dog"
LENGTH = 60


@pytest.fixture(scope="module")
def mtp(smollm2_path, tmp_path_factory):
    """{kind: path}: random heads (almost nothing accepted), copying heads (everything accepted),
    loose ones (a spread law, drafts accepted and rejected), and a file whose metadata names an
    MTP block it lacks."""
    folder = tmp_path_factory.mktemp("mtp")
    return {
        "random": write_tiny_mtp(folder / "mtp-random.gguf", smollm2_path),
        "copying": write_tiny_mtp(folder / "mtp-copying.gguf", smollm2_path, copying=True),
        "loose": write_tiny_mtp(folder / "mtp-loose.gguf", smollm2_path, copying=True, loose=True),
        "from_state": write_tiny_mtp(folder / "mtp-state.gguf", smollm2_path, copying=True, from_state=True),
        "stripped": write_tiny_mtp(folder / "mtp-stripped.gguf", smollm2_path, heads=False),
    }


@pytest.fixture(scope="module")
def engines(mtp):
    made = {
        kind: edgespec.load(target=str(mtp[kind]), n_ctx=1024, cache_ram=0) for kind in ("random", "copying", "loose")
    }
    yield made
    for engine in made.values():
        engine.close()


def test_heads_are_found_by_their_tensors(mtp, smollm2_path):
    """A file with the MTP block has heads; one whose metadata names the block it lacks (llama.cpp
    aborts on an MTP context there) and a model without any have none."""
    assert has_heads(mtp["random"]) and has_heads(mtp["copying"])
    assert not has_heads(mtp["stripped"]) and not has_heads(smollm2_path)


def test_a_target_with_heads_drafts_with_them(engines):
    assert engines["random"].draft_name == "its own MTP heads"
    assert engines["random"].draft_model is None  # no second model file


@pytest.mark.parametrize("kind", ["random", "copying"])
@pytest.mark.parametrize("mode", ["model", "auto"])
def test_greedy_answers_with_heads_are_llamas(engines, kind, mode, monkeypatch):
    """Forced to draft (model mode, γ 3) and in auto mode (on a GPU's costs, where the heads'
    step is cheap: on this CPU a tiny model's head costs what its target does), the greedy answer
    is Llama's; the copying heads are accepted throughout, the random ones almost never."""
    engine = engines[kind]
    monkeypatch.setattr(engine, "costs", GpuCosts())
    gamma = 3 if mode == "model" else "auto"
    answer = engine.generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0, draft_mode=mode, gamma=gamma)
    assert_greedy_as_llama(f"{kind} {mode}", engine, PROMPT, answer.tokens, raw=True, limit=LENGTH)
    stats = answer.stats
    if mode == "auto" and kind == "random":  # unsure heads: their next likeliest tokens verified beside theirs
        assert stats.tree_rounds > 0
        chains = engine.generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0, trees=False)
        assert chains.stats.tree_rounds == 0 and chains.tokens == answer.tokens
    if mode == "model":
        assert stats.rounds_by_source["heads"] >= stats.rounds - 1  # every round but the last (no room) drafted
        if kind == "copying":
            assert stats.accepted_by_source["heads"] == stats.drafted_by_source["heads"] > LENGTH / 2
        else:
            assert stats.accepted_by_source.get("heads", 0) < stats.drafted_by_source["heads"] / 4


class HalfStepCosts(GpuCosts):
    """A GPU's costs, with a head's step half the target's: drafting pays only where most drafts are accepted."""

    def draft_step(self, drafter):
        return FixedCurve({k: 0.005 for k in calibration.DRAFT_SIZES})


def test_auto_mode_leaves_useless_heads_out(engines, monkeypatch):
    """Where a head's step is half the target's, auto mode drafts next to nothing with random heads
    that accept almost nothing, and keeps drafting with the copying ones, their acceptance learnt
    under their own name."""
    for engine in engines.values():
        monkeypatch.setattr(engine, "costs", HalfStepCosts())
    useless = engines["random"].generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0).stats
    # (a round planned for them may stop before its first token: their own confidence is low)
    assert useless.drafted_by_source.get("heads", 0) < useless.rounds / 3
    useful = engines["copying"].generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0).stats
    # (the copy drafter takes most rounds: the copying model repeats itself, and copies are free)
    assert useful.accepted_by_source["heads"] == useful.drafted_by_source["heads"] > 0
    assert useless.alpha_by_source["heads"] < MODEL_PRIOR_ALPHA < useful.alpha_by_source["heads"]  # learnt from them


def test_on_this_machine_auto_drafts_with_heads_only_where_they_pay(engines):
    """On this machine's measured costs the tiny model's head step is no cheaper than its target's:
    auto drafts nothing with them (never slower than the target alone), and says so in the stats."""
    stats = engines["copying"].generate(PROMPT, raw=True, max_tokens=20, temperature=0).stats
    step = engines["copying"].costs.draft_step(engines["copying"].drafter)(1)
    verify = engines["copying"].costs.curve(engines["copying"].target)(1)
    if step > verify / 2:  # (measured: a cheap step would make drafting pay, and this test moot)
        assert stats.rounds_by_source.get("heads", 0) == 0


def test_the_next_turn_drafts_after_the_cached_prompt(engines):
    """A second request that continues the first: the heads keep what they wrote, write the new
    part, and the answer is still Llama's."""
    engine = engines["copying"]
    first = engine.generate(PROMPT, raw=True, max_tokens=10, temperature=0, draft_mode="model", gamma=3)
    longer = PROMPT + first.text + " and then"
    second = engine.generate(longer, raw=True, max_tokens=20, temperature=0, draft_mode="model", gamma=3)
    assert_greedy_as_llama("next turn", engine, longer, second.tokens, raw=True, limit=20)
    assert second.stats.accepted_by_source["heads"] > 10


def test_sampled_drafts_from_heads_keep_the_targets_law(engines):
    """The first token over 1500 seeded runs with the loose heads drafting (their q given for the
    acceptance test) follows the target's law, through accepted drafts and resampled tokens."""
    params = dict(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0)
    assert_first_token_law(engines["loose"], PROMPT, params, 3, 1500, draft_mode="model")


def test_sampled_trees_from_heads_keep_the_targets_law(engines, monkeypatch):
    """With trees (a GPU's costs, γ planned), the loose heads' siblings drawn without replacement
    and accepted by recursive rejection sampling: the first token still follows the target's law."""
    monkeypatch.setattr(engines["loose"], "costs", GpuCosts())
    params = dict(temperature=0.7, top_k=20, top_p=1.0, min_p=0.0)
    answer = engines["loose"].generate(PROMPT, raw=True, max_tokens=16, seed=1, draft_mode="model", **params)
    assert answer.stats.tree_rounds > 0
    assert_first_token_law(engines["loose"], PROMPT, params, "auto", 600, draft_mode="model")


def test_a_tree_pass_keeps_the_hidden_states_of_the_branch_taken(mtp):
    """What the heads read after a tree round: the target's hidden states of the root and of the
    path it took (on the first branch, on another, on none) are those a chain's pass leaves."""
    target = Model(mtp["random"], n_ctx=256, load_mtp=True)
    target.hidden.export()
    prompt = target.text_tokens(PROMPT)
    nodes, parents = [300, 100, 400, 500, 200, 600], [-1, -1, 0, 2, 2, 1]

    def chain_states(tokens: list[int]) -> np.ndarray:
        target.cache.truncate(0)
        target.hidden.take()
        target.eval(tokens)
        return target.hidden.take().rows(0, len(tokens))

    for path in ([0, 2, 3], [0, 2, 4], [1, 5], []):
        target.cache.truncate(0)
        target.eval(prompt[:-1])
        target.decode([Pass(target.seq, prompt[-1:] + nodes, len(nodes) + 1, parents=parents)])
        target.cache.keep(path)
        held = target.hidden.take()
        taken = prompt + [nodes[node] for node in path]
        assert (held.at, held.end) == (0, len(taken))
        np.testing.assert_allclose(held.rows(0, len(taken)), chain_states(taken), atol=1e-3)
    target.close()


def test_draft_auto_takes_the_heads_first(mtp):
    choice = find_draft(str(mtp["copying"]), offline=True, progress=False)
    assert choice.draft == HEADS
    assert choice.candidates[0].verdict == "its own MTP heads: no second model file"
    stripped = find_draft(str(mtp["stripped"]), offline=True, progress=False)
    assert stripped.draft != HEADS
    assert stripped.candidates[0].verdict == "MTP heads named in its metadata, not in its file"


def test_heads_asked_of_a_model_without_them_is_one_line(mtp):
    with pytest.raises(EdgespecError, match="has no MTP heads of its own; give a draft model"):
        edgespec.load(target=str(mtp["stripped"]), draft="heads", n_ctx=512)
    with edgespec.load(target=str(mtp["stripped"]), n_ctx=512, cache_ram=0) as engine:  # runs without
        assert engine.drafter is None
        assert engine.generate(PROMPT, raw=True, max_tokens=5, temperature=0).stats.n_tokens == 5


@pytest.mark.parametrize("draft", [None, "heads", "auto"])
def test_the_command_line_drafts_with_the_heads(mtp, capsys, draft):
    """As --help says: a target alone, --draft heads and --draft auto all draft with its heads."""
    chosen = ["--draft", draft] if draft else []
    code, out, err = run(capsys, "generate", "--target", str(mtp["copying"]), *chosen, "--raw", "--max-tokens", "20",
                         "--temperature", "0", "--draft-mode", "model", "--gamma", "3", "--json", PROMPT)  # fmt: skip
    assert code == 0, err
    stats = json.loads(out)["stats"]
    assert stats["accepted_by_source"]["heads"] >= 15
    if draft == "auto":
        assert "the target's own MTP heads" in err


def test_hidden_states_follow_the_cache():
    """What the target keeps for its heads: rows per position, a later decode's rows in place of
    those from its first position on, a gap starting anew, cut back with the cache, bounded."""
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    held = HiddenStates(0, [rows[:3]]).add(HiddenStates(3, [rows[3:]]))
    assert (held.at, held.end) == (0, 6) and np.array_equal(held.rows(2, 5), rows[2:5])
    redone = held.add(HiddenStates(4, [rows[:1] + 100]))  # position 4 decoded again (after a cut)
    assert redone.end == 5 and np.array_equal(redone.rows(3, 5), [rows[3], rows[0] + 100])
    assert held.add(HiddenStates(9, [rows[:1]])).at == 9  # not following: the newer alone
    assert held.cut(2).end == 2 and held.cut(0) is None and held.cut(99).end == 6
    bounded = held.add(HiddenStates(6, [rows]), limit=rows[:4].nbytes)
    assert bounded.at == 6 and bounded.end == 12  # the oldest blocks dropped past the limit


def test_the_heads_step_is_timed_leaving_their_cache_as_it_was(engines):
    """The calibration times a step of the MTP layers on top of what they hold, and cuts back: the
    next turn still drafts after the cached prompt, and its answer is Llama's."""
    engine = engines["copying"]
    first = engine.generate(PROMPT, raw=True, max_tokens=8, temperature=0, draft_mode="model", gamma=3)
    heads, seq = engine.drafter.heads, engine.target.seq
    held = heads.positions(seq)
    curve = calibration.measure_heads(heads)
    assert heads.positions(seq) == held > 0 and 0 < curve(1) <= curve(2)
    longer = PROMPT + first.text
    second = engine.generate(longer, raw=True, max_tokens=12, temperature=0, draft_mode="model", gamma=3)
    assert_greedy_as_llama("after timing", engine, longer, second.tokens, raw=True, limit=12)
    assert second.stats.accepted_by_source["heads"] >= 8


def test_a_hybrid_target_drafts_with_its_heads_exactly(smollm2_path, tmp_path):
    """Qwen3.5 (Gated DeltaNet and attention) with its MTP block: its recurrent state is cut back by
    llama.cpp's snapshots after every rejected draft, its hidden states kept across those cuts,
    and the greedy answer is Llama's."""
    path = write_tiny(tmp_path / "qwen35-mtp.gguf", "qwen35", smollm2_path, mtp=True)
    with edgespec.load(target=str(path), n_ctx=1024, cache_ram=0) as engine:
        assert engine.draft_name == "its own MTP heads" and engine.target.cache.rollback.value == "snapshots"
        answer = engine.generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0, draft_mode="model", gamma=3)
        assert_greedy_as_llama("qwen35 with heads", engine, PROMPT, answer.tokens, raw=True, limit=LENGTH)
        assert answer.stats.drafted_by_source["heads"] > LENGTH  # (random heads: nearly all rejected, cut back)


def test_the_heads_read_the_targets_hidden_state(mtp):
    """Heads that predict from the target's hidden state alone (eh_proj = [0 | I]) are accepted
    throughout: each position is written with the state the target left before it."""
    with edgespec.load(target=str(mtp["from_state"]), n_ctx=1024, cache_ram=0) as engine:
        answer = engine.generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0, draft_mode="model", gamma=3)
        assert_greedy_as_llama("from the state", engine, PROMPT, answer.tokens, raw=True, limit=LENGTH)
        stats = answer.stats
        # (the first round's state is the prompt's token before the last, which the answer does not repeat)
        assert stats.accepted_by_source["heads"] >= stats.drafted_by_source["heads"] - 3 > LENGTH / 2
