"""Real models for real tests: fetched once into the user's edgespec cache."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from edgespec import Engine, Model, ModelDrafter
from edgespec.loader import resolve_model
from edgespec.sampling import distribution, position_uniforms

NEAR_TIE = 1.0  # logits; see assert_greedy_match
near_ties: list[str] = []


@pytest.fixture(scope="session")
def smollm2_path():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def requantized_path(smollm2_path, tmp_path_factory):
    """SmolLM2 re-quantized to Q4_0 with llama.cpp's quantize API: a draft whose q differs from p."""
    out = tmp_path_factory.mktemp("requant") / "smollm2-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(smollm2_path).encode(), str(out).encode(), params) == 0
    return out


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    model = Model(smollm2_path, n_ctx=1024)
    yield model
    model.close()


@pytest.fixture(scope="session")
def self_engine(smollm2, smollm2_path):
    """SmolLM2 drafting for itself (p == q up to batch-size float noise)."""
    draft = Model(smollm2_path, n_ctx=1024)
    yield Engine(smollm2, ModelDrafter(draft, smollm2.n_vocab), gamma=4, draft_mode="model")
    draft.close()


@pytest.fixture(scope="session")
def requant_engine(smollm2, requantized_path):
    """SmolLM2 drafted by its Q4_0 re-quantization (p != q)."""
    draft = Model(requantized_path, n_ctx=1024)
    yield Engine(smollm2, ModelDrafter(draft, smollm2.n_vocab), gamma=4, draft_mode="model")
    draft.close()


def replay_margins(model: Model, prompt: list[int], output: list[int]) -> list[float]:
    """Top-2 logit gap at each generated position, replaying `output` one token per
    decode as the no-draft run computed it."""
    margins = []
    model.truncate(0)
    logits = model.eval(prompt)
    for token in output:
        top2 = np.partition(logits, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        logits = model.eval([token])
    model.truncate(0)
    return margins


def assert_greedy_match(name: str, model: Model, prompt: list[int], baseline: list[int], speculative: list[int]):
    """Greedy speculative output must equal the no-draft output token for token, or
    up to a first divergence where the no-draft run's top-2 logits are within
    NEAR_TIE: llama.cpp's logits shift slightly with the decode batch size."""
    if speculative == baseline:
        return
    n = min(len(baseline), len(speculative))
    first = next((i for i in range(n) if baseline[i] != speculative[i]), n)
    assert first < n, f"{name}: one output is a strict prefix of the other ({len(baseline)} vs {len(speculative)})"
    margin = replay_margins(model, prompt, baseline[: first + 1])[first]
    assert margin < NEAR_TIE, f"{name}: outputs diverge at token {first} where the no-draft top-2 gap is {margin:.3f}"
    near_ties.append(f"{name}: diverged at token {first}/{n}, top-2 gap {margin:.3f}")


BOUNDARY = 0.02  # of probability mass; see assert_sampled_match


def assert_sampled_match(name, model, prompt, baseline, other, params, seed):
    """A seeded sampled answer must equal the no-draft one token for token (both draw
    position i's token with the same uniform u_i), or up to a first divergence where u_i
    lies within BOUNDARY of the cumulative-probability edge between the two tokens: the
    logits llama.cpp computes in a batch differ slightly from a single decode's, which
    moves that edge a little."""
    if other == baseline:
        return
    n = min(len(baseline), len(other))
    first = next((i for i in range(n) if baseline[i] != other[i]), n)
    assert first < n, f"{name}: one output is a strict prefix of the other ({len(baseline)} vs {len(other)})"
    model.truncate(0)
    logits = model.eval(prompt + baseline[:first])
    model.truncate(0)
    cum = np.cumsum(distribution(logits, params))
    u = position_uniforms(seed, len(prompt) + first, 1)[0, 1] * cum[-1]
    edge = cum[min(baseline[first], other[first])]
    assert abs(edge - u) < BOUNDARY, (
        f"{name}: outputs diverge at token {first}, u {u:.3f} is {abs(edge - u):.3f} from the edge"
    )
    near_ties.append(f"{name}: diverged at token {first}/{n}, u {abs(edge - u):.4f} from the edge")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_sep("-", f"equality with no-draft runs: {len(near_ties)} float near-tie divergence(s)")
    for line in near_ties:
        terminalreporter.write_line(line)
