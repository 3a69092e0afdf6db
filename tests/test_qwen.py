"""The default pair: Qwen2.5-Coder 1.5B target drafted by 0.5B."""

from __future__ import annotations

import pytest
from conftest import assert_greedy_match

from edgespec import Engine, Model, ModelDrafter
from edgespec.loader import resolve_model
from edgespec.model import compatibility_problem

pytestmark = pytest.mark.slow  # the Qwen pair

PROMPT = "Write a Python function that merges two sorted lists into one sorted list."


@pytest.fixture(scope="module")
def qwen_engine():
    target = Model(resolve_model("qwen2.5-coder-1.5b"), n_ctx=2048)
    draft = Model(resolve_model("qwen2.5-coder-0.5b"), n_ctx=2048)
    with Engine(
        target, ModelDrafter(draft, target.n_vocab), gamma=3, draft_mode="model", owned=[target, draft]
    ) as engine:
        yield engine


def test_qwen_pair_is_compatible(qwen_engine):
    assert compatibility_problem(qwen_engine.target, qwen_engine.draft_model) is None


def test_qwen_greedy_speculative_equals_no_draft(qwen_engine):
    baseline = qwen_engine.generate(PROMPT, speculative=False, temperature=0, max_tokens=64)
    spec = qwen_engine.generate(PROMPT, temperature=0, max_tokens=64)
    assert baseline.stats.n_tokens == spec.stats.n_tokens == 64
    tokens = qwen_engine.prompt_tokens(PROMPT)
    assert_greedy_match("qwen-coder", qwen_engine.target, tokens, baseline.tokens, spec.tokens)
    assert spec.stats.acceptance_rate > 0.5, spec.stats.summary()
