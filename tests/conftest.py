"""Real models for real tests: fetched once into the user's edgespec cache."""

from __future__ import annotations

import os
import tempfile

import llama_cpp
import numpy as np
import pytest
from reference import excused
from tiny_models import write_tiny

from edgespec import Engine, Model, ModelDrafter, calibration
from edgespec.cost_curve import UNSPREAD, BatchSpread, CostCurve
from edgespec.costs import MachineCosts
from edgespec.drafters import HeadsDrafter
from edgespec.resolve import resolve_model
from edgespec.sampling import distribution, position_uniforms

# the user's own memory of prompts and answers (memory.py) is never read or written by the tests,
# nor one left by an earlier run: every process they start shares this session's empty one. It is
# off but where a test turns it on (test_memory.py): the other tests judge other drafters, and an
# answer drafted from another test's answer would be verified in other pass shapes
os.environ["EDGESPEC_MEMORY_HOME"] = tempfile.mkdtemp(prefix="edgespec-memory-")
os.environ["EDGESPEC_MEMORY"] = "off"

near_ties: list[str] = []  # seeded sampled answers that part at a float edge (assert_sampled_match)


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
    """The target of the exactness tests, with flash attention: llama.cpp's CPU kernels then round a
    verify pass as they do a single step (measured: see reference.py), so greedy answers must equal
    llama-cpp-python's exactly."""
    model = Model(smollm2_path, n_ctx=1024, flash_attn=True)
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


def tiny_pair(folder, tokenizer, n_seq: int = 1) -> Engine:
    """A tiny random transformer with `tokenizer`'s vocabulary (tiny_models.py), drafted by a
    copy of it whose last block is perturbed (q != p, accepted about half the time at
    TINY_TEMPERATURE), n_seq sequences in each context: the sampled-law tests' pair, a pass a
    few ms where a real model's is tens."""
    target = Model(write_tiny(folder / "tiny.gguf", "llama", tokenizer), n_ctx=1024, flash_attn=True, n_seq=n_seq)
    draft = Model(write_tiny(folder / "tiny-draft.gguf", "llama", tokenizer, noise=0.3), n_ctx=1024, n_seq=n_seq)
    return Engine(target, ModelDrafter(draft, target.n_vocab), gamma=3, draft_mode="model", owned=[target, draft])


TINY_TEMPERATURE = 3.0  # a random model's logits are peaked: at 3 its law spreads over a score of tokens


@pytest.fixture(scope="session")
def tiny_engine(smollm2_path, tmp_path_factory):
    """tiny_pair on SmolLM2's 49,152 tokens."""
    with tiny_pair(tmp_path_factory.mktemp("tiny"), smollm2_path) as engine:
        yield engine


def with_a_word_changed(text: str) -> str:
    """A prediction of `text` that is wrong in its middle word: copies hold up to it, are rejected
    there, and are found again after it."""
    words = text.split(" ")
    words[len(words) // 2] = "banana"
    return " ".join(words)


class GpuCosts(MachineCosts):
    """Costs as on a GPU, whatever this machine measures: a pass of up to 64 tokens costs one step,
    a draft model's step a tenth of one. Auto then drafts wherever a draft has a chance, so that an
    auto case cannot pass by never drafting (this CPU's costs may say drafting does not pay)."""

    def curve(self, model: Model, sizes=calibration.TARGET_SIZES) -> CostCurve:
        step = 0.01 if sizes == calibration.TARGET_SIZES else 0.001
        return self._curves.setdefault((model, sizes), FixedCurve({k: step for k in sizes}))

    def spread(self, model: Model) -> BatchSpread:
        return UNSPREAD  # a pass spread over sequences costs as one sequence's

    def draft_step(self, drafter):
        if isinstance(drafter, HeadsDrafter):  # the target's heads: a step a tenth of the target's, as a draft model's
            return FixedCurve({k: 0.001 for k in calibration.DRAFT_SIZES})
        return super().draft_step(drafter)


class FixedCurve(CostCurve):
    """A curve that real rounds do not move: GpuCosts' curves stay a GPU's (this CPU's rounds
    would make V(2) dearer than V(1) within a few answers, and a draft not worth its step)."""

    def observe(self, k: int, seconds: float) -> None:
        pass


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
    model.cache.truncate(0)
    logits = model.eval(prompt + baseline[:first])
    model.cache.truncate(0)
    cum = np.cumsum(distribution(logits, params))
    u = position_uniforms(seed, len(prompt) + first, 1)[0, 1] * cum[-1]
    edge = cum[min(baseline[first], other[first])]
    assert abs(edge - u) < BOUNDARY, (
        f"{name}: outputs diverge at token {first}, u {u:.3f} is {abs(edge - u):.3f} from the edge"
    )
    near_ties.append(f"{name}: diverged at token {first}/{n}, u {abs(edge - u):.4f} from the edge")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_sep("-", f"greedy answers as Llama's: {len(excused)} float near-tie divergence(s)")
    for line in excused:
        terminalreporter.write_line(line)
    terminalreporter.write_sep("-", f"seeded answers with and without drafts: {len(near_ties)} float edge(s)")
    for line in near_ties:
        terminalreporter.write_line(line)
