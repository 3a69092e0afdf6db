"""The default pair: Qwen2.5-Coder 1.5B target drafted by 0.5B."""

from __future__ import annotations

from pathlib import Path

import pytest
from reference import assert_greedy_as_llama

from edgespec import Engine, Model, ModelDrafter
from edgespec.resolve import resolve_model
from edgespec.tokenizer import compatibility_problem

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
    assert_greedy_as_llama("qwen-coder alone", qwen_engine, PROMPT, baseline.tokens, limit=64)
    assert_greedy_as_llama("qwen-coder", qwen_engine, PROMPT, spec.tokens, limit=64)
    assert spec.stats.acceptance_rate > 0.5, spec.stats.summary()


MODULE = (Path(__file__).parent / "data" / "rename_module.py").read_text()
RENAME = (
    "Rename the variable `records` to `entries` everywhere in this file (parameters and locals too)"
    f" and return the whole file, unchanged otherwise.\n\n```python\n{MODULE}```"
)


def test_a_prediction_never_costs_rounds_on_a_code_edit(qwen_engine):
    """The edit an editor sends: the original file as the prediction, one renamed a little too
    widely, or the answer itself; each gives the same answer as none, in no more rounds (fixed
    copy drafting, γ 64: rounds do not depend on timing); the answer itself in at most 0.6x."""

    def edit(prediction: str | None):
        return qwen_engine.generate(
            RENAME, temperature=0, max_tokens=256, draft_mode="copy", gamma=64, prediction=prediction
        )

    alone = edit(None)
    too_wide = MODULE.replace("records", "entries").replace("Record", "Entry")
    rounds = {}
    for name, prediction in (("original", MODULE), ("near", too_wide), ("answer", alone.text)):
        answer = edit(prediction)
        assert answer.tokens == alone.tokens, name
        rounds[name] = answer.stats.rounds
        assert answer.stats.rounds <= alone.stats.rounds, (name, rounds, alone.stats.rounds)
    assert rounds["answer"] <= 0.6 * alone.stats.rounds, (rounds, alone.stats.rounds)
