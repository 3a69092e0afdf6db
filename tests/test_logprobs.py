"""Log-probabilities (Request.logprobs, Request.prompt_logprobs): the target's own log-softmax,
equal to what llama-cpp-python's Llama reports for the same prompt and tokens, whatever drafted
the answer (nothing, the draft model, a copy of a prediction) and under a grammar.

A drafted token's value comes from the verify pass, a batch of tokens, where llama.cpp's CPU
kernels may round otherwise than in a one-token pass: measured on a 2-core AMD EPYC, SmolLM2's
logits from a 9-token pass differ from one-token passes' by up to 1.4 without flash attention
and not at all with it (Qwen2.5-Coder-0.5B: 0.3-0.4 either way). The engine here runs with
flash attention, and the bound for drafted tokens is 1e-4 or, on a machine where llama.cpp's
batched pass differs, what the test measures that difference to be (batch_noise)."""

from __future__ import annotations

import numpy as np
import pytest
from llama_cpp import Llama
from reference import reference_for

from edgespec import Engine, Model, ModelDrafter, Request
from edgespec.errors import EdgespecError
from edgespec.logprobs import MAX_TOP, log_softmax

PROMPT = "def fibonacci(n):\n    "
LENGTH = 32
TOP = 5
CLOSE = 1e-4


@pytest.fixture(scope="module")
def engine(smollm2_path):
    """SmolLM2 drafting for itself, the target with flash attention as the Llama below (and the
    same kernels, see plain_llama), so that the two can be compared to 1e-4."""
    target = Model(smollm2_path, n_ctx=1024, flash_attn=True)
    draft = Model(smollm2_path, n_ctx=1024)
    with Engine(target, ModelDrafter(draft, target.n_vocab), gamma=4, owned=[target, draft]) as e:
        yield e


@pytest.fixture(scope="module")
def llama(engine):
    return reference_for(engine.target).llm  # Llama as the target is set up (reference.py)


def llama_logprobs(llm: Llama, prompt: list[int], answer: list[int] = ()) -> np.ndarray:
    """Llama's own log-probabilities after each token of prompt + answer (row i: of the token after
    the i-th), evaluated as Llama generates: the prompt in one batch, then one token a pass (a
    batch of dozens of tokens goes through other kernels: its logits differ by up to ~0.03 here)."""
    llm.reset()
    llm.eval(prompt)
    for token in answer:
        llm.eval([token])
    return Llama.logits_to_logprobs(np.array(llm.scores[: len(prompt) + len(answer)]))


def batch_noise(model: Model, prompt: list[int], answer: list[int], width: int = 5) -> float:
    """How far llama.cpp's log-probabilities of `answer` from passes of `width` tokens (a verify
    pass's) are from one-token passes' on this machine (0 where its kernels round alike)."""
    model.cache.cut(0)
    model.eval(prompt[:-1])
    rows, inputs = [], prompt[-1:] + answer[:-1]  # row i scores answer[i]
    for at in range(0, len(inputs), width):
        batch = inputs[at : at + width]
        rows += [log_softmax(r) for r in model.eval(batch, rows=len(batch))]
    model.cache.cut(len(prompt) - 1)
    single = [log_softmax(model.eval([t])) for t in inputs]
    return max(abs(b[t] - s[t]) for b, s, t in zip(rows, single, answer, strict=True))


def greedy(engine: Engine, **options):
    return engine.generate(Request.of(PROMPT, raw=True, temperature=0, max_tokens=LENGTH, logprobs=TOP, **options))


def assert_equal_to_llama(llm: Llama, prompt: list[int], answer, close: float = CLOSE) -> None:
    rows = llama_logprobs(llm, prompt, answer.tokens)[len(prompt) - 1 :]
    assert [t.token for t in answer.logprobs] == answer.tokens
    for scored, row in zip(answer.logprobs, rows, strict=False):
        assert abs(scored.logprob - row[scored.token]) < close
        assert len(scored.top) == TOP
        top = np.sort(row)[::-1][:TOP]
        assert np.allclose([a.logprob for a in scored.top], top, atol=close)
        assert all(abs(a.logprob - row[a.token]) < close for a in scored.top)


def test_answer_logprobs_equal_llamas_with_and_without_speculation(engine, llama):
    prompt = engine.prompt_tokens(Request(PROMPT, raw=True))
    plain = greedy(engine, speculative=False)
    # Llama's own completion, its own logprobs: the same tokens and values
    completion = llama.create_completion(prompt, max_tokens=LENGTH, temperature=0, logprobs=TOP)
    assert completion["choices"][0]["text"] == plain.text
    theirs = completion["choices"][0]["logprobs"]["token_logprobs"]
    assert np.allclose([t.logprob for t in plain.logprobs], theirs, atol=CLOSE)
    assert_equal_to_llama(llama, prompt, plain)
    for scored in plain.logprobs:  # greedy: the chosen token is the likeliest
        assert scored.top[0].logprob == scored.logprob

    model = greedy(engine, draft_mode="model", gamma=4)
    copied = greedy(engine, draft_mode="copy", gamma=4, prediction=plain.text)
    assert model.stats.accepted_by_source.get("model", 0) > 0
    assert copied.stats.accepted_by_source.get("prediction", 0) > 0
    close = max(CLOSE, 2 * batch_noise(engine.target, prompt, plain.tokens))
    for answer in (model, copied):
        assert answer.tokens == plain.tokens
        assert_equal_to_llama(llama, prompt, answer, close)


def test_logprobs_under_a_grammar_are_the_models_own(engine, llama):
    """A grammar changes which tokens are drawn, not what they are reported to be worth."""
    prompt = engine.prompt_tokens(Request(PROMPT, raw=True))
    answer = greedy(engine, grammar='root ::= "return " [a-z]+ "(" [a-z0-9 -]* ")"')
    assert answer.text.startswith("return ")
    assert_equal_to_llama(llama, prompt, answer)


def test_prompt_logprobs_score_every_prompt_token_after_the_first(engine, llama):
    prompt = engine.prompt_tokens(Request(PROMPT, raw=True))
    engine.generate(Request(PROMPT, raw=True, max_tokens=4))  # the prompt in the cache: it must be read again
    scored = engine.generate(Request(PROMPT, raw=True, max_tokens=0, logprobs=2, prompt_logprobs=True))
    assert scored.stats.n_prompt_cached == 0 and scored.tokens == []
    assert [t.token for t in scored.prompt_logprobs] == prompt
    assert scored.prompt_logprobs[0].logprob is None
    rows = llama_logprobs(llama, prompt)
    for i, t in enumerate(scored.prompt_logprobs[1:]):
        assert abs(t.logprob - rows[i][t.token]) < CLOSE
        assert len(t.top) == 2


def test_nothing_changes_when_logprobs_are_not_asked_for(engine):
    asked = greedy(engine, draft_mode="model", gamma=4)
    quiet = engine.generate(Request.of(PROMPT, raw=True, temperature=0, max_tokens=LENGTH, draft_mode="model"))
    assert quiet.text == asked.text and quiet.logprobs == [] and quiet.prompt_logprobs == []
    seeded = dict(temperature=0.8, seed=7, max_tokens=LENGTH, raw=True)
    assert engine.generate(Request.of(PROMPT, **seeded, logprobs=3)).text == engine.generate(PROMPT, **seeded).text


@pytest.mark.parametrize("bad", [-1, MAX_TOP + 1, True, 2.5])
def test_a_bad_count_of_alternatives_is_refused(bad):
    with pytest.raises(EdgespecError, match="'logprobs'.*0..20"):
        Request("hi", logprobs=bad)
