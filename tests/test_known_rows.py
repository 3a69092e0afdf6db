"""An answer to a prompt answered before (llama.vscode's n_cmpl, a regenerated answer) is drawn
from the rows the earlier answer's passes computed, with no pass, where it goes the same way; it
is still the target's (known_rows.py)."""

from __future__ import annotations

import numpy as np
import pytest
from reference import assert_greedy_as_llama, chi_square_pvalue, law_after

from edgespec import Engine

STORY = "Once upon a time, in a small village by the sea, there lived"
PARAMS = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)


def test_an_answer_asked_again_takes_no_pass_and_is_llamas(smollm2):
    engine = Engine(smollm2, None)
    first = engine.generate(STORY, raw=True, temperature=0, max_tokens=24)
    again = engine.generate(STORY, raw=True, temperature=0, max_tokens=24, again=True)
    assert first.stats.known_tokens == 0 and first.stats.rounds > 0
    assert again.stats.known_tokens == 24 and again.stats.rounds == 0 and again.tokens == first.tokens
    assert_greedy_as_llama("asked again", engine, STORY, again.tokens, raw=True, limit=24)
    longer = engine.generate(STORY, raw=True, temperature=0, max_tokens=30, again=True)  # the path, then passes
    assert longer.stats.known_tokens == 24 and longer.stats.rounds > 0 and longer.tokens[:24] == first.tokens
    fresh = engine.generate(STORY, raw=True, temperature=0, max_tokens=24)  # not asked again: passes of its own
    assert fresh.stats.known_tokens == 0 and fresh.tokens == first.tokens
    alone = engine.generate(STORY, raw=True, temperature=0, max_tokens=24, draft_mode="off", again=True)
    assert alone.stats.known_tokens == 0 and alone.stats.rounds == 24


@pytest.mark.slow
def test_answers_drawn_from_known_rows_keep_the_targets_law(smollm2):
    """Sampled: the first two tokens over 1500 answers follow the target's joint law p(t1) p(t2 | t1)
    (chi-square), each answer after the first drawn from the first's rows: the path taken (its
    tokens point masses) or left."""
    engine, runs = Engine(smollm2, None), 1500
    p1 = law_after(engine, STORY, width=1, **PARAMS)
    support = np.flatnonzero(p1)
    p2 = {int(t): law_after(engine, STORY, [int(t)], width=1, **PARAMS) for t in support}
    joint = np.concatenate([p1[t] * p2[int(t)] for t in support])
    counts = np.zeros(len(support) * len(p1))
    rng, known = np.random.default_rng(13), 0
    for _ in range(runs):
        seed = int(rng.integers(2**32))
        answer = engine.generate(STORY, raw=True, max_tokens=2, seed=seed, again=True, **PARAMS)
        first, second = answer.tokens
        counts[int(np.flatnonzero(support == first)[0]) * len(p1) + second] += 1
        known += answer.stats.known_tokens
    assert known > runs  # the first token always, the second where the first took the path
    assert chi_square_pvalue(counts, joint, runs) > 0.01
