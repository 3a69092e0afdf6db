"""Draft trees (issue 49): several candidates verified in one target pass, exact, shaped by the
machine's costs. SmolLM2-135M drafted by its own Q4_0 re-quantization (a draft whose q is not p,
whose confidence is often split); exactness judged against llama-cpp-python's Llama."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_TEMPERATURE, FixedCurve, GpuCosts
from reference import assert_first_token_law, assert_greedy_as_llama, reference_for

from edgespec import Engine, Model, ModelDrafter, calibration
from edgespec.drafters import Branching, Draft
from edgespec.drafters.copy import Alternative, branched
from edgespec.passes import Pass
from edgespec.sampling import SamplingParams

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
LENGTH = 48


class SteepCosts(GpuCosts):
    """A CPU's shape: each token more in a pass costs half a step (a draft step still a tenth of one)."""

    def curve(self, model, sizes=calibration.TARGET_SIZES):
        if sizes != calibration.TARGET_SIZES:
            return super().curve(model, sizes)
        return self._curves.setdefault((model, sizes), FixedCurve({k: 0.01 * (1 + 0.5 * (k - 1)) for k in sizes}))


@pytest.fixture(scope="module")
def engine(smollm2, requantized_path):
    draft = Model(requantized_path, n_ctx=1024)
    yield Engine(smollm2, ModelDrafter(draft, smollm2.n_vocab), gamma="auto", draft_mode="auto")
    draft.close()


def test_a_tree_pass_gives_each_branch_its_own_rows(smollm2):
    """Each node's row is the one Llama computes after the node's own branch (siblings, cousins
    and their positions unseen); after keep(), the cache holds the branch taken as Llama would."""
    llm = reference_for(smollm2).llm
    prompt = smollm2.text_tokens("The quick brown fox jumps over the lazy dog. The quick brown")
    nodes, parents = [300, 100, 400, 500, 200, 600], [-1, -1, 0, 2, 2, 1]

    def branch(node: int) -> list[int]:
        return [] if node < 0 else branch(parents[node]) + [nodes[node]]

    def llama_row(tokens: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(tokens)
        return np.array(llm.scores[len(tokens) - 1])

    for taken in ([0, 2, 3], [0, 2, 4], [1, 5], []):
        smollm2.cache.truncate(0)
        smollm2.eval(prompt[:-1])
        tree = Pass(smollm2.seq, prompt[-1:] + nodes, len(nodes) + 1, parents=parents)
        smollm2.decode([tree])
        rows = np.array(tree.result())
        for node in range(-1, len(nodes)):
            expected = llama_row(prompt + branch(node))
            assert int(np.argmax(rows[node + 1])) == int(np.argmax(expected)), f"node {node}"
            np.testing.assert_allclose(rows[node + 1], expected, atol=0.05)
        smollm2.cache.keep(taken)
        kept = [nodes[i] for i in taken]
        assert kept[: len(smollm2.tokens) - len(prompt)] == smollm2.tokens[len(prompt) :]
        after = np.array(smollm2.eval((prompt + kept)[len(smollm2.tokens) :] + [777]))
        np.testing.assert_allclose(after, llama_row(prompt + kept + [777]), atol=0.05)
    smollm2.cache.truncate(0)


def test_greedy_answers_with_trees_are_llamas(engine, monkeypatch):
    """On a GPU's flat costs the draft model branches where it is unsure; the greedy answer is
    Llama's, with trees and without."""
    monkeypatch.setattr(engine, "costs", GpuCosts())
    with_trees = engine.generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0)
    assert with_trees.stats.tree_rounds > 0 and with_trees.stats.tree_drafted > with_trees.stats.tree_rounds
    assert 0 <= with_trees.stats.alpha_by_source["model-sibling1"] <= 1  # the share of its siblings taken
    assert_greedy_as_llama("trees", engine, PROMPT, with_trees.tokens, raw=True, limit=LENGTH)
    chains = engine.generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0, trees=False)
    assert chains.stats.tree_rounds == 0
    assert chains.tokens == with_trees.tokens


def test_the_draft_model_grows_branches_below_its_siblings(engine):
    """Where its siblings are likely enough, the draft model reads the whole tree in one pass a
    level and drafts below them: each node's first child is the draft model's argmax after the
    node's own branch, as Llama computes it from the draft's file; its other children its next
    likeliest; no branch is deeper than the chain."""
    drafter, draft_model = engine.drafter, engine.draft_model
    context = draft_model.text_tokens(PROMPT)
    drafter.begin(context)
    branching = Branching(lambda k: 0.02, pass_cost=lambda k: 0.0)  # any node of a 2% chance, any pass
    draft = drafter.draft(context, 4, SamplingParams(temperature=0), np.random.default_rng(0), branching=branching)
    drafter.accept(context)
    chain = [0]
    while (child := next((i for i, p in enumerate(draft.parents) if p == chain[-1]), None)) is not None:
        chain.append(child)
    below = [i for i, parent in enumerate(draft.parents) if parent >= 0 and parent not in chain]
    assert draft.grown > 0 and below and draft.depth == len(chain) <= 4

    llm = reference_for(draft_model).llm

    def branch(node: int) -> list[int]:
        return [] if node < 0 else branch(draft.parents[node]) + [draft.tokens[node]]

    for parent in sorted(set(draft.parents)):
        children = [draft.tokens[i] for i, p in enumerate(draft.parents) if p == parent]
        llm.reset()
        llm.eval(context + branch(parent))
        row = np.array(llm.scores[llm.n_tokens - 1])
        likeliest = np.argsort(-row)[: len(children)]
        # (the draft model's pass over a tree rounds as a chain's does within this model's noise)
        assert row[children].min() >= row[likeliest].min() - 0.05, (parent, children, likeliest)
        assert row[children[0]] >= row.max() - 0.05


def test_the_shape_follows_the_machines_costs(engine, monkeypatch):
    """Where one token more in a pass costs half a step (a CPU), no sibling of the draft model's
    is worth it (each is less likely than its chain's token): chains are drafted (the draft model
    still pays); where it costs nothing (a GPU), trees."""
    monkeypatch.setattr(engine, "costs", SteepCosts())
    steep = engine.generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0, draft_mode="model")
    assert steep.stats.rounds_by_source.get("model", 0) > 0, steep.stats.rounds_by_source
    assert steep.stats.tree_rounds == 0
    monkeypatch.setattr(engine, "costs", GpuCosts())
    flat = engine.generate(PROMPT, raw=True, max_tokens=LENGTH, temperature=0, draft_mode="model")
    assert flat.stats.tree_rounds > 0
    assert flat.tokens == steep.tokens


def test_sampled_answers_with_trees_keep_the_targets_law(tiny_engine, monkeypatch):
    """The first token of seeded answers follows the law from Llama's logits (chi-square), drawn
    through siblings accepted by recursive rejection sampling and resampled: judged on runs of
    which many took a sibling (a tiny pair, whose draft is often wrong: the law is the point)."""
    monkeypatch.setattr(tiny_engine, "costs", GpuCosts())
    params = {"temperature": TINY_TEMPERATURE, "top_k": 8, "top_p": 1.0, "min_p": 0.0}
    taken = assert_first_token_law(tiny_engine, PROMPT, params, "auto", 1500, draft_mode="model")
    assert taken >= 100, taken


CALLS = "total = add(1, 2)\nprint(total)\ntotal = add(3, 4)\nprint(total)\ntotal = mul(1, 2)\nprint(total)\n"
CALLS += "total = add("


@pytest.fixture(scope="module")
def copier(smollm2):
    return Engine(smollm2, None, gamma="auto", draft_mode="copy")


def test_copies_branch_where_the_text_went_on_otherwise(copier, monkeypatch):
    """`add(` was followed by `1, 2)` and by `3, 4)`: the copy drafts one, the other is a branch
    of the same pass (point masses); the greedy answer is Llama's. On a CPU's steep costs the
    branch does not pay: chains only."""
    monkeypatch.setattr(copier, "costs", GpuCosts())
    flat = copier.generate(CALLS, raw=True, max_tokens=LENGTH, temperature=0)
    assert flat.stats.tree_rounds > 0
    assert "copy-sibling1" in flat.stats.alpha_by_source  # its branches were reached, and judged
    assert_greedy_as_llama("copy trees", copier, CALLS, flat.tokens, raw=True, limit=LENGTH)
    monkeypatch.setattr(copier, "costs", SteepCosts())
    steep = copier.generate(CALLS, raw=True, max_tokens=LENGTH, temperature=0)
    assert steep.stats.rounds_by_source.get("copy", 0) > 0 and steep.stats.tree_rounds == 0
    assert steep.tokens == flat.tokens


def test_a_copys_branch_is_weighed_by_the_trust_learnt_for_its_rank():
    """A copy's alternative is grafted where its chance of being taken (its share, at most the
    copy's 1 - α, weighed by its rank's trust) beats its place in the pass; the text after it
    is copied text again (α). The chances kept for learning are as judged, without the trust."""
    chain, other = Draft([1, 2, 3, 4], None, source="copy"), Alternative([1, 5, 6, 7], share=0.4)
    tree, gain = branched(chain, [other], alpha=0.8, branching=Branching(lambda k: 0.1))
    assert tree.tokens == [1, 2, 3, 4, 5, 6, 7] and tree.parents == [-1, 0, 1, 2, 0, 4, 5]
    assert tree.chances == pytest.approx([0.8, 0.8, 0.8, 0.8, 0.2, 0.8, 0.8])
    assert gain == pytest.approx(0.8 * 0.2 * (1 + 0.8 + 0.8**2))  # each node's chance of being reached and taken
    distrusted = Branching(lambda k: 0.1, trust=(0.5, 1.0, 1.0))
    tree, gain = branched(chain, [other], alpha=0.8, branching=distrusted)
    assert tree.parents is None and gain == 0


def test_seeded_answers_are_the_same_with_copy_trees(copier, monkeypatch):
    """A copy's branches are point masses, accepted where the position's own draw is one of them:
    a seeded answer at temperature 1 is token for token the one drafted without trees."""
    monkeypatch.setattr(copier, "costs", GpuCosts())
    params = {"temperature": 1.0, "top_k": 40, "seed": 7}
    with_trees = copier.generate(CALLS, raw=True, max_tokens=LENGTH, **params)
    assert with_trees.stats.tree_rounds > 0
    chains = copier.generate(CALLS, raw=True, max_tokens=LENGTH, trees=False, **params)
    assert chains.tokens == with_trees.tokens
