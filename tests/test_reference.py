"""The references the exactness tests trust (reference.py), checked against llama.cpp itself:
the sampling chain written there gives the law llama.cpp's own samplers leave on the same logits,
and the reference's greedy answer is the one llama-cpp-python's Llama generates."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest
from reference import chain_law, reference_for

from edgespec import Engine

PARAMS = [
    dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05),  # llama.cpp's defaults
    dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),  # no filter
    dict(temperature=1.5, top_k=20, top_p=1.0, min_p=0.0),
    dict(temperature=0.8, top_k=0, top_p=0.5, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=1, top_p=1.0, min_p=0.0),
]


def llama_cpp_law(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The law llama.cpp's own sampler chain (top-k, top-p, min-p, temperature: the order of its
    common sampler) leaves on `logits`: the survivors' softmax, before the final draw."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for sampler in (
        llama_cpp.llama_sampler_init_top_k(top_k),
        llama_cpp.llama_sampler_init_top_p(top_p, 1),
        llama_cpp.llama_sampler_init_min_p(min_p, 1),
        llama_cpp.llama_sampler_init_temp(temperature),
    ):
        llama_cpp.llama_sampler_chain_add(chain, sampler)
    data = np.zeros(len(logits), dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    data["id"], data["logit"] = np.arange(len(logits)), logits
    pointer = data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
    array = llama_cpp.llama_token_data_array(data=pointer, size=len(data), selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
    llama_cpp.llama_sampler_free(chain)  # (frees the samplers it holds)
    survivors = data[: array.size]
    z = survivors["logit"].astype(np.float64)
    law = np.zeros(len(logits))
    law[survivors["id"]] = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    return law


@pytest.mark.parametrize("params", PARAMS, ids=[str(p) for p in PARAMS])
def test_the_chain_written_in_the_tests_is_llama_cpps(smollm2, params):
    """On real rows (SmolLM2 after several prompts) and on made ones of a 151k vocabulary (peaked,
    flat, heavy-tailed): the same tokens survive, with the same probabilities. (llama.cpp sums top-p's
    mass in float32: on the flat row, whose top half is 75k tokens of 1.3e-5 each, 5 more tokens
    pass its boundary; such a boundary may differ by 1e-4 of the survivors.)"""
    reference = reference_for(smollm2)
    rows = []
    for text in ("The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, there"):
        tokens = reference.prompt(text, raw=True)
        reference.llm.reset()
        reference.llm.eval(tokens)
        rows.append(np.array(reference.llm.scores[len(tokens) - 1]))
    rng = np.random.default_rng(3)
    n = 151_936
    rows += [
        rng.standard_normal(n) * 2 + np.where(np.arange(n) == 17, 30.0, 0.0),
        rng.standard_normal(n) * 0.01,
        rng.standard_t(2, n) * 3,
    ]
    for row in rows:
        row = row.astype(np.float32)
        ours, theirs = chain_law(row, **params), llama_cpp_law(row, **params)
        survivors = set(np.flatnonzero(ours))
        assert len(survivors ^ set(np.flatnonzero(theirs))) <= 1e-4 * len(survivors)
        np.testing.assert_allclose(ours, theirs, atol=2e-5)


def test_the_greedy_reference_is_llamas_own_generation(smollm2):
    """reference.greedy (argmax of Llama's rows, one token a pass) is what Llama.generate gives at
    temperature 0 with its own sampler, and the engine's prompt is Llama's tokenization."""
    reference = reference_for(smollm2)
    prompt = reference.prompt("List three facts about the Moon.", raw=False)
    assert Engine(smollm2).prompt_tokens("List three facts about the Moon.") == prompt
    ours = reference.greedy(prompt, 32)
    theirs = []
    for token in reference.llm.generate(prompt, temp=0, reset=True):
        if llama_cpp.llama_vocab_is_eog(reference.vocab, token) or len(theirs) == 32:
            break
        theirs.append(token)
    assert len(ours) == 32 and ours == theirs
