"""The probability math, exactly and by simulation (no model; the chain it must equal is reference.py's)."""

from __future__ import annotations

import numpy as np
import pytest
from reference import chain_law
from scipy import stats as scipy_stats

from edgespec import EdgespecError, SamplingParams
from edgespec.drafters.base import without
from edgespec.sampling import (
    Law,
    acceptance_probability,
    distribution,
    position_uniforms,
    residual,
    verify,
    verify_greedy,
    verify_tree,
    verify_tree_greedy,
)

RNG = np.random.default_rng(0)


def random_dist(v: int, support: int | None = None, rng=RNG) -> np.ndarray:
    p = rng.dirichlet(np.ones(v) * 0.5)
    if support is not None:  # zero all but `support` random entries
        p[rng.permutation(v)[support:]] = 0.0
    return p / p.sum()


def law_of(p: np.ndarray) -> Law:
    """The law of a dense distribution p (need not be normalised)."""
    ids = np.flatnonzero(p)
    return Law(ids, p[ids] / p[ids].sum())


def output_distribution(p: np.ndarray, q: np.ndarray | None, draft_token: int | None = None) -> np.ndarray:
    """Exact distribution of the token one verification step emits: draw x ~ q
    (or take the deterministic x), accept w.p. a(x), else draw from the residual."""
    out = np.zeros_like(p)
    p_law, q_law = law_of(p), None if q is None else law_of(q)
    xs = [(draft_token, 1.0)] if q is None else [(x, q[x]) for x in np.flatnonzero(q)]
    for x, q_x in xs:
        a = acceptance_probability(p_law, q_law, x)
        out[x] += q_x * a
        out += q_x * (1 - a) * residual(p_law, q_law, x).dense(len(p))
    return out


@pytest.mark.parametrize("case", ["dense", "truncated", "disjoint", "equal"])
def test_accept_plus_residual_is_exactly_p(case):
    for _ in range(50):
        v = 12
        if case == "dense":
            p, q = random_dist(v), random_dist(v)
        elif case == "truncated":  # top-k-like supports that partly overlap
            p, q = random_dist(v, support=4), random_dist(v, support=5)
        elif case == "disjoint":
            p = np.r_[random_dist(6), np.zeros(6)]
            q = np.r_[np.zeros(6), random_dist(6)]
        else:
            p = random_dist(v)
            q = p.copy()
        np.testing.assert_allclose(output_distribution(p, q), p, atol=1e-9)


def test_point_mass_draft_is_exactly_p():
    for _ in range(50):
        p = random_dist(10, support=6)
        for x in range(10):  # also drafts the target gives probability 0
            np.testing.assert_allclose(output_distribution(p, None, x), p, atol=1e-9)


def test_verify_monte_carlo_two_tokens():
    """End to end through verify(): with γ=2 over a toy context-dependent model,
    the first two emitted tokens are distributed as the target's joint."""
    v, rng = 4, np.random.default_rng(1)
    p_table = {c: random_dist(v, rng=rng) for c in [(), *[(a,) for a in range(v)]]}
    q_table = {c: random_dist(v, rng=rng) for c in p_table}
    counts = np.zeros((v, v))
    n = 20000
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            ctx = tuple(out)
            draft, q_rows = [], []
            for _ in range(2):
                q = q_table[ctx + tuple(draft)] if len(ctx) + len(draft) < 2 else random_dist(v, rng=rng)
                draft.append(law_of(q).sample(rng.random()))
                q_rows.append(law_of(q))
            p_rows = [law_of(p_table.get(ctx + tuple(draft[:i]), np.full(v, 1 / v))) for i in range(3)]
            k, nxt = verify(draft, q_rows, p_rows.__getitem__, rng.random((3, 2)))
            out += draft[:k] + [nxt]
        counts[out[0], out[1]] += 1
    expected = np.array([[p_table[()][a] * p_table[(a,)][b] for b in range(v)] for a in range(v)]) * n
    assert scipy_stats.chisquare(counts.ravel(), expected.ravel()).pvalue > 0.01


def test_sample_follows_distribution():
    rng = np.random.default_rng(2)
    p = np.array([0.5, 0.0, 0.3, 0.2, 0.0])
    draws = np.bincount([law_of(p).sample(rng.random()) for _ in range(20000)], minlength=5)
    assert draws[1] == draws[4] == 0
    assert scipy_stats.chisquare(draws[[0, 2, 3]], p[[0, 2, 3]] * 20000).pvalue > 0.01


def test_point_mass_verification_is_the_plain_draw_at_each_position():
    """A deterministic draft is accepted exactly when the position's own draw from p is the
    draft token, and otherwise that draw is the next token: whatever is drafted, the tokens
    out are those sampling without a draft would give with the same uniforms."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        p_rows = [law_of(random_dist(6, support=4, rng=rng)) for _ in range(4)]
        uniforms = rng.random((4, 2))
        plain = [p.sample(u) for p, (_, u) in zip(p_rows, uniforms, strict=True)]
        for draft in ([], plain[:3], [plain[0], (plain[1] + 1) % 6, 0], list(rng.integers(0, 6, 3))):
            n, nxt = verify(draft, None, p_rows.__getitem__, uniforms[: len(draft) + 1])
            assert draft[:n] + [nxt] == plain[: n + 1]


def test_position_uniforms_depend_on_seed_and_position_only():
    a = position_uniforms(7, 10, 5)
    np.testing.assert_array_equal(a[2:], position_uniforms(7, 12, 3))
    assert not np.array_equal(a, position_uniforms(8, 10, 5)) and a.shape == (5, 2)


def test_verify_greedy():
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8].__getitem__) == (3, 8)
    assert verify_greedy([5, 9, 7], [5, 6, 7, 8].__getitem__) == (1, 6)
    assert verify_greedy([], [4].__getitem__) == (0, 4)


def test_distribution_filters():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.07, 0.03]))
    plain = distribution(logits, SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0))
    np.testing.assert_allclose(plain, [0.4, 0.3, 0.2, 0.07, 0.03], atol=1e-12)
    top2 = distribution(logits, SamplingParams(temperature=1, top_k=2, top_p=1, min_p=0))
    np.testing.assert_allclose(top2, [4 / 7, 3 / 7, 0, 0, 0], atol=1e-12)
    top_p = distribution(logits, SamplingParams(temperature=1, top_k=0, top_p=0.75, min_p=0))
    np.testing.assert_allclose(top_p, [4 / 9, 3 / 9, 2 / 9, 0, 0], atol=1e-12)
    min_p = distribution(logits, SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.6))
    np.testing.assert_allclose(min_p, [4 / 7, 3 / 7, 0, 0, 0], atol=1e-12)
    hot = distribution(logits, SamplingParams(temperature=2, top_k=0, top_p=1, min_p=0))
    expected = np.sqrt([0.4, 0.3, 0.2, 0.07, 0.03])
    np.testing.assert_allclose(hot, expected / expected.sum(), atol=1e-12)
    greedy = distribution(logits, SamplingParams(temperature=0))
    np.testing.assert_array_equal(greedy, [1, 0, 0, 0, 0])


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top-p"),
        ({"top_p": 1.5}, "top-p"),
        ({"top_k": -1}, "top-k"),
        ({"min_p": 2}, "min-p"),
    ],
)
def test_bad_sampling_params(kwargs, word):
    with pytest.raises(EdgespecError, match=word):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("top_k", [0, 1, 40, 1000])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.5])
@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_law_on_candidates_is_the_whole_vocabularys(top_k, top_p, min_p):
    """Found without sorting the vocabulary, the law equals the chain over all of it: on
    peaked, flat and heavy-tailed logits (the gap search must widen for some of them), on
    a 151k vocabulary, with masked (-inf) tokens."""
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    n = 151_936
    cases = {
        "peaked": rng.standard_normal(n) * 2 + np.where(np.arange(n) == 17, 30.0, 0.0),
        "flat": rng.standard_normal(n) * 0.01,
        "heavy": rng.standard_t(2, n) * 3,
        "masked": np.where(rng.random(n) < 0.999, -np.inf, rng.standard_normal(n)),
    }
    for name, logits in cases.items():
        logits = logits.astype(np.float32)
        expected = chain_law(logits, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
        np.testing.assert_allclose(distribution(logits, params), expected, atol=1e-9, err_msg=name)


def tree_round(p_table, q_table, v, rng, *, copy: bool):
    """One round of a tree over a toy context-dependent model: two siblings drawn from q without
    replacement after the context, the first with a child drawn from q after it; with `copy`, a
    deterministic sibling (a copy's alternative: token 0) and a point mass after it too. Returns
    the tokens it gives."""
    tokens, parents, q_rows = [], [], []
    q = law_of(q_table[()])
    for _ in range(2):  # siblings without replacement: each with the law it was drawn from
        tokens.append(q.sample(rng.random()))
        parents.append(-1)
        q_rows.append(q)
        q = without(q, tokens[-1])
    child_q = law_of(q_table[(tokens[0],)])
    tokens.append(child_q.sample(rng.random()))
    parents.append(0)
    q_rows.append(child_q)
    if copy and 0 not in tokens[:2]:
        tokens += [0, 1]
        parents += [-1, len(tokens) - 2]
        q_rows += [None, None]
    branch = {-1: ()}  # node -> its tokens from the context
    for node, parent in enumerate(parents):
        branch[node] = branch[parent] + (tokens[node],)
    uniform_law = np.full(v, 1 / v)
    p_rows = [law_of(p_table.get(branch[node], uniform_law)) for node in range(-1, len(tokens))]
    path, nxt = verify_tree(tokens, parents, q_rows, p_rows.__getitem__, rng.random((3, 4)))
    return [tokens[i] for i in path] + [nxt]


@pytest.mark.parametrize("copy", [False, True])
def test_verify_tree_monte_carlo_two_tokens(copy):
    """Recursive rejection sampling among siblings (sampled ones from q without replacement, and
    a copy's point masses): the first two tokens of a tree round follow the target's joint law."""
    v, rng = 4, np.random.default_rng(5)
    p_table = {c: random_dist(v, rng=rng) for c in [(), *[(a,) for a in range(v)]]}
    q_table = {c: random_dist(v, rng=rng) for c in p_table}
    counts = np.zeros((v, v))
    n = 20000
    for _ in range(n):
        out = tree_round(p_table, q_table, v, rng, copy=copy)
        if len(out) < 2:  # nothing accepted: the second token from the target's own law after the first
            out.append(law_of(p_table[(out[0],)]).sample(rng.random()))
        counts[out[0], out[1]] += 1
    expected = np.array([[p_table[()][a] * p_table[(a,)][b] for b in range(v)] for a in range(v)]) * n
    assert scipy_stats.chisquare(counts.ravel(), expected.ravel()).pvalue > 0.01


def test_verify_tree_without_the_residual_leaves_the_law():
    """The test above can fail: siblings each accepted by min(1, p/q) against the target's own
    law (no residual between them) give another law, which the same check rejects."""
    v, rng = 4, np.random.default_rng(5)
    p_table = {c: random_dist(v, rng=rng) for c in [(), *[(a,) for a in range(v)]]}
    q_table = {c: random_dist(v, rng=rng) for c in p_table}
    counts = np.zeros(v)
    p, n = law_of(p_table[()]), 20000
    for _ in range(n):
        q = law_of(q_table[()])
        first, u = q.sample(rng.random()), rng.random(3)
        second = without(q, first).sample(rng.random())
        if u[0] < acceptance_probability(p, q, first):
            counts[first] += 1
        elif u[1] < acceptance_probability(p, without(q, first), second):  # broken: p where the residual goes
            counts[second] += 1
        else:
            counts[residual(residual(p, q, first), without(q, first), second).sample(u[2])] += 1
    assert scipy_stats.chisquare(counts, p_table[()] * n).pvalue < 0.01


def test_verify_tree_greedy_descends_to_the_targets_choice():
    # the context -> 5 (two siblings: 5 and 7), 5 -> 6, 7 -> 8
    tokens, parents = [5, 7, 6, 8], [-1, -1, 0, 1]
    choices = {0: 7, 1: 6, 2: 8, 3: 1, 4: 4}  # row -> the target's argmax (row i + 1: after node i)
    assert verify_tree_greedy(tokens, parents, choices.__getitem__) == ([1, 3], 4)
    assert verify_tree_greedy(tokens, parents, {0: 3}.__getitem__) == ([], 3)
    assert verify_tree_greedy([5, 6], None, {0: 5, 1: 6, 2: 1}.__getitem__) == ([0, 1], 1)


def test_a_tree_of_point_masses_keeps_a_seeded_answer():
    """Copies' alternatives are point masses: the round descends only where the position's own
    draw is one of them, so the tokens out are those sampling without a draft would give."""
    rng = np.random.default_rng(6)
    for _ in range(200):
        p_rows = [law_of(random_dist(4, rng=rng)) for _ in range(6)]
        uniforms = rng.random((3, 3))
        tokens, parents = [0, 1, 2, 3, 0], [-1, -1, -1, 0, 1]
        path, nxt = verify_tree(tokens, parents, None, p_rows.__getitem__, uniforms)
        plain = p_rows[0].sample(uniforms[0, 1])
        assert ([tokens[i] for i in path] + [nxt])[0] == plain
