"""Recurrent and hybrid models (issue 22), on tiny random-weight GGUFs that llama.cpp runs as
it runs the real ones (tiny_models.py): Mamba (recurrent state only: checkpoints), Jamba
(Mamba and attention layers: checkpoints), LFM2 (short convolutions and attention) and
Qwen3.5 (Gated DeltaNet and attention), both with llama.cpp's snapshots. Each cut of the
cache is exact, and speculation on them gives the target's output: greedy token for token,
sampled in law."""

from __future__ import annotations

import json

import llama_cpp
import numpy as np
import pytest
from conftest import GpuCosts, with_a_word_changed
from reference import assert_first_token_law, assert_greedy_as_llama
from replay import controller_on
from test_cli import run
from tiny_models import ARCHS, write_tiny

import edgespec
from edgespec import Engine, Model, ModelDrafter
from edgespec.cost_curve import CostCurve, RollbackCost
from edgespec.drafters import CopyDrafter
from edgespec.kv_cache import Rollback
from edgespec.passes import decoded_alone

pytestmark = pytest.mark.slow  # models written with the gguf package

EXPECTED = {
    "mamba": Rollback.CHECKPOINTS,
    "jamba": Rollback.CHECKPOINTS,
    "lfm2": Rollback.SNAPSHOTS,
    "qwen35": Rollback.SNAPSHOTS,
}
PROMPT = [1, 504, 2329, 28, 1789, 3726, 28, 1347, 2791, 30]  # any tokens: the models are random
LENGTH = 120


@pytest.fixture(scope="module")
def tiny(smollm2_path, tmp_path_factory):
    """{arch: (target path, draft path)}: the draft is the target's weights with noise added."""
    folder = tmp_path_factory.mktemp("tiny")
    return {
        arch: (
            write_tiny(folder / f"{arch}.gguf", arch, smollm2_path),
            write_tiny(folder / f"{arch}-draft.gguf", arch, smollm2_path, noise=0.3),
        )
        for arch in ARCHS
    }


@pytest.fixture(scope="module")
def engines(tiny):
    """{arch: Engine of the target with its noisy copy as draft model}, as load() makes them."""
    made = {arch: edgespec.load(target=str(t), draft=str(d), n_ctx=1024, cache_ram=0) for arch, (t, d) in tiny.items()}
    yield made
    for engine in made.values():
        engine.close()


def fresh_logits(model: Model, tokens: list[int]) -> np.ndarray:
    """The last token's logits from an empty cache."""
    model.cache.truncate(0)
    return np.array(model.eval(tokens))


def assert_same_logits(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal up to llama.cpp's batch-size float noise (here ~0.002 on logits of spread 8; a
    state off by even one token moves them by whole units)."""
    np.testing.assert_allclose(actual, expected, atol=0.02)


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_kind_is_found_by_asking_llama_cpp(engines, arch):
    engine = engines[arch]
    assert engine.target.recurrent and engine.target.cache.rollback is EXPECTED[arch]
    assert engine.draft_model.n_snapshots == 0  # a draft model has no use for snapshots


@pytest.mark.parametrize("arch", ARCHS)
def test_every_cut_is_exact(engines, arch):
    """Cut back to a checkpoint, within one pass (llama.cpp's snapshots on LFM2) and with
    neither (from scratch): the next logits equal a fresh run's, and Model.tokens is what
    the cache holds."""
    model = engines[arch].target

    def check(n: int) -> None:
        assert model.tokens == PROMPT[:n]
        after_cut = np.array(model.eval(PROMPT[n : n + 1]))
        assert_same_logits(after_cut, fresh_logits(model, PROMPT[: n + 1]))

    model.cache.truncate(0)
    model.eval(PROMPT[:5])
    model.cache.checkpoint()
    model.eval(PROMPT[5:])
    model.cache.truncate(6)  # the checkpoint at 5, then one token again
    check(6)

    model.cache.truncate(0)
    model.eval(PROMPT[:6])
    model.eval(PROMPT[6:9])  # one pass of 3, cut back by 2
    model.cache.truncate(7)
    assert model.state.snapshot_pending == (EXPECTED[arch] is Rollback.SNAPSHOTS)  # the snapshot was used
    check(7)

    model.cache.truncate(0)
    for token in PROMPT[:9]:  # passes of one token, no checkpoint: only from scratch
        model.eval([token])
    model.cache.truncate(3)
    check(3)
    model.cache.truncate(0)


def test_llama_cpp_refuses_a_partial_removal_and_the_model_notices(engines):
    """llama.cpp cannot cut a Mamba state: its seq_rm says so, and truncate recovers exactly."""
    model = engines["mamba"].target
    model.cache.truncate(0)
    model.eval(PROMPT)
    assert not llama_cpp.llama_memory_seq_rm(model.llama_memory, 0, 5, -1)  # the refusal itself
    model.cache.truncate(5)  # no checkpoint, no snapshot: evaluated again from scratch
    assert model.tokens == PROMPT[:5]
    after_cut = np.array(model.eval(PROMPT[5:6]))
    assert_same_logits(after_cut, fresh_logits(model, PROMPT[:6]))
    model.cache.truncate(0)


RUNS = [
    ("copy", dict(draft_mode="copy", gamma=4)),
    ("copy-auto", dict(draft_mode="copy")),
    ("model", dict(draft_mode="model", gamma=4)),
    ("model-auto", dict(draft_mode="model")),
    ("hybrid", dict(draft_mode="hybrid", gamma=3)),
    ("auto", dict(draft_mode="auto")),
]


@pytest.mark.parametrize("name,kwargs", RUNS, ids=[r[0] for r in RUNS])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculation_equals_the_target_alone(engines, arch, name, kwargs, monkeypatch):
    engine = engines[arch]
    monkeypatch.setattr(engine, "costs", GpuCosts())  # auto drafts (see GpuCosts)
    baseline = engine.generate(PROMPT_TEXT, raw=True, speculative=False, max_tokens=LENGTH, temperature=0)
    # random weights never repeat themselves: copies come from a prediction, the answer with every
    # 8th token changed, so that copies are accepted for 7 tokens and then rejected
    changed = [t + 1 if i % 8 == 7 else t for i, t in enumerate(baseline.tokens)]
    prediction = b"".join(engine.target.piece(t) for t in changed).decode("utf-8", "replace")
    other = engine.generate(PROMPT_TEXT, raw=True, max_tokens=LENGTH, temperature=0, prediction=prediction, **kwargs)
    assert_greedy_as_llama(f"{arch} alone", engine, PROMPT_TEXT, baseline.tokens, raw=True, limit=LENGTH)
    assert_greedy_as_llama(f"{arch} {name}", engine, PROMPT_TEXT, other.tokens, raw=True, limit=LENGTH)
    assert len(baseline.tokens) >= 100 or baseline.finish_reason == "stop"
    stats = other.stats
    assert stats.rollback == EXPECTED[arch].value
    # every mode drafts (auto too: the prediction is the client's word) and is rejected at changed tokens
    assert stats.drafted > stats.accepted, stats.as_dict()
    if name in ("copy", "model", "hybrid"):
        assert stats.accepted > 0, stats.as_dict()


PROMPT_TEXT = "one two three, one two three, one two three, one two"


def test_a_rejection_costs_a_recurrent_target_no_pass_of_its_own(engines):
    """Mamba's state is cut back by a checkpoint restore: the kept tokens after the checkpoint
    go into the next verify pass, so every round is one target pass, whatever is rejected."""
    engine = engines["mamba"]
    baseline = engine.generate(PROMPT_TEXT, raw=True, speculative=False, max_tokens=60, temperature=0)
    changed = [t + 1 if i % 8 == 7 else t for i, t in enumerate(baseline.tokens)]
    prediction = b"".join(engine.target.piece(t) for t in changed).decode("utf-8", "replace")
    passes = []  # (tokens, rows of logits) of each target pass
    plain = engine.target.eval
    engine.target.eval = lambda tokens, rows=None: passes.append((len(tokens), rows)) or plain(tokens, rows=rows)
    try:
        other = engine.generate(
            PROMPT_TEXT, raw=True, max_tokens=60, temperature=0, prediction=prediction, draft_mode="copy", gamma=4
        )
    finally:
        del engine.target.eval
    assert other.tokens == baseline.tokens
    first_round = next(i for i, (_, rows) in enumerate(passes) if rows is not None)  # (prefill passes make one row)
    rounds = passes[first_round:]  # nothing but verify passes from there: no pass to evaluate kept tokens again
    assert all(rows is not None for _, rows in rounds), rounds
    assert len(rounds) == other.stats.rounds and other.stats.drafted > other.stats.accepted > 0
    assert any(size > rows for size, rows in rounds)  # kept tokens rode along after a rejection


@pytest.mark.parametrize("arch", ["jamba", "mamba"])
def test_sampled_speculation_keeps_the_targets_law_on_a_hybrid(engines, arch):
    """The first token over 1500 seeded runs through the (noisy) draft model on Jamba (a hybrid) and
    Mamba (recurrent only) follows the target's law (chi-square, against the reference's), with both
    accepted drafts and resampled tokens."""
    params = dict(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0)
    assert_first_token_law(engines[arch], PROMPT_TEXT, params, 3, 1500, draft_mode="model")


def test_prompt_cache_reuses_only_states_saved_at_that_prefix(tiny):
    """A recurrent state cannot be cut back: a saved state comes back only for a prompt that
    continues all of it, and cached_tokens says what was really reused."""
    first = " ".join(["alpha beta gamma"] * 80)
    other = " ".join(["delta epsilon"] * 90)
    with edgespec.load(target=str(tiny["mamba"][0]), n_ctx=1024, cache_ram=64) as engine:
        n_first = len(engine.prompt_tokens(first, raw=True))
        for answer_tokens, reused in ((1, n_first), (4, 0)):
            engine.forget()
            # one token without drafts leaves exactly the prompt in the cache; four leave the answer's start too
            engine.generate(first, raw=True, max_tokens=answer_tokens, temperature=0, speculative=False)
            engine.generate(other, raw=True, max_tokens=2, temperature=0)  # the first prompt's state is saved
            again = engine.generate(first + " zeta", raw=True, max_tokens=8, temperature=0)
            assert again.stats.n_prompt_cached == reused
            engine.forget()
            fresh = engine.generate(first + " zeta", raw=True, max_tokens=8, temperature=0, speculative=False)
            assert again.tokens == fresh.tokens


def test_a_conversation_on_a_hybrid_reuses_its_cache(engines):
    engine = engines["jamba"]
    engine.forget()
    messages = [{"role": "user", "content": "Count: one two three"}]
    first = engine.chat(messages, max_tokens=12, temperature=0)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Again"}]
    second = engine.chat(messages, max_tokens=12, temperature=0)
    assert second.stats.n_prompt_cached > first.stats.n_prompt
    engine.forget()
    assert engine.chat(messages, max_tokens=12, temperature=0, speculative=False).tokens == second.tokens


def test_context_of_a_recurrent_model_is_a_position_limit(tiny):
    """Mamba keeps nothing per token: the default context is the trained one."""
    model = Model(tiny["mamba"][0])
    try:
        assert model.n_ctx == model.n_ctx_train == 4096
    finally:
        model.close()


def test_controller_prices_rollback():
    """A sure copy (a long repeat) that pays on attention alone does not pay when each round
    needs a costly checkpoint and restore; a cheap rollback leaves the choice as it was. A
    doubtful copy pays with a free rollback (the kept tokens ride in the next pass, beside its
    own token), not when a restore costs a step."""
    curve = CostCurve({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 1.8})
    text = list(range(100, 160))

    def plan_with(rollback, context=text * 2 + text[:40]):
        controller = controller_on("auto", None, curve, None, None, CopyDrafter(), verify_rollback=rollback)
        decoded_alone(controller.begin(context))
        return controller.plan(context, 100)

    assert plan_with(None).source == "copy"
    assert plan_with(RollbackCost(0.01, 0.01)).source == "copy"
    assert plan_with(RollbackCost(100.0, 100.0)).source == "off"
    assert plan_with(RollbackCost(100.0, 100.0, snapshots=64)).source == "copy"  # snapshots need neither
    doubtful = [5, 6, 7, 8, 9, 5, 6, 7, 8]
    assert plan_with(None, doubtful).source == "copy"
    assert plan_with(RollbackCost(0.0, 0.0), doubtful).source == "copy"
    assert plan_with(RollbackCost(0.0, 1.0), doubtful).source == "off"


@pytest.mark.parametrize("arch", ["mamba", "lfm2"])
def test_cli_generate_and_bench_on_recurrent_models(capsys, tiny, arch):
    target, draft = (str(p) for p in tiny[arch])
    code, out, err = run(capsys, "generate", PROMPT_TEXT, "--raw", "--target", target, "--max-tokens", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["stats"]["rollback"] == EXPECTED[arch].value
    code, out, err = run(capsys, "generate", "hi", "--target", target, "--draft", draft, "--max-tokens", "8")
    assert code == 0, err
    assert f"rollback by {EXPECTED[arch].value}" in err.splitlines()[-1]
    code, out, err = run(
        capsys, "bench", "--target", target, "--draft", draft, "--repeats", "1", "--max-tokens", "8",
        "--prompts", "chat", "--modes", "copy,auto", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["rollback"]["kind"] == EXPECTED[arch].value


def test_engine_on_a_recurrent_model_as_library(tiny):
    target = Model(tiny["jamba"][0], n_ctx=512)
    draft = Model(tiny["jamba"][1], n_ctx=512, snapshots=0)
    engine = Engine(target, ModelDrafter(draft, target.n_vocab), gamma=3, draft_mode="model", owned=[target, draft])
    with engine:
        answer = engine.generate(PROMPT_TEXT, raw=True, max_tokens=30, temperature=0)
        assert answer.stats.drafted > 0
        assert_greedy_as_llama("jamba library", engine, PROMPT_TEXT, answer.tokens, raw=True, limit=30)


# --- Gemma 3: sliding-window attention, a 262k-token vocabulary ----------------------


@pytest.fixture(scope="module")
def gemma():
    with edgespec.load(target="gemma-3-270m", n_ctx=1024, cache_ram=0) as engine:
        yield engine


GEMMA_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"


@pytest.mark.parametrize("kwargs", [dict(draft_mode="copy", gamma=4), dict(draft_mode="copy"), dict(draft_mode="auto")])
def test_gemma_greedy_equal_across_modes(gemma, kwargs, monkeypatch):
    monkeypatch.setattr(gemma, "costs", GpuCosts())  # auto drafts (see GpuCosts)
    baseline = gemma.generate(GEMMA_PROMPT, raw=True, max_tokens=60, temperature=0, speculative=False)
    assert gemma.target.cache.rollback is Rollback.TRUNCATE and gemma.target.n_vocab == 262144
    prediction = with_a_word_changed(baseline.text)
    other = gemma.generate(GEMMA_PROMPT, raw=True, max_tokens=60, temperature=0, prediction=prediction, **kwargs)
    assert_greedy_as_llama("gemma alone", gemma, GEMMA_PROMPT, baseline.tokens, raw=True, limit=60)
    assert_greedy_as_llama(f"gemma {kwargs}", gemma, GEMMA_PROMPT, other.tokens, raw=True, limit=60)
    assert other.stats.drafted > other.stats.accepted, other.stats.as_dict()  # auto too: a client's prediction
    if "gamma" in kwargs:
        assert other.stats.accepted > 0


def test_chat_app_and_server_on_a_hybrid(monkeypatch, tiny):
    """`edgespec chat` and `edgespec serve` on Jamba with its draft model: answers, no traceback."""
    from test_server import Server
    from test_smoke import chat_command_stats

    target, draft = (str(p) for p in tiny["jamba"])
    stats = chat_command_stats(monkeypatch, "--target", target, "--draft", draft, "--ctx", "512")
    assert stats.n_tokens > 0 and stats.rollback == "checkpoints"

    server = Server("--target", target, "--draft", draft, "--ctx", "512")
    try:
        reply = server.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=12
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        stream = server.client().completions.create(model="m", prompt=PROMPT_TEXT, max_tokens=12, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    finally:
        assert server.stop() == 0
    assert "Traceback" not in "".join(server.lines)


def test_bench_on_a_base_model_without_a_chat_template(capsys):
    """Gemma 3 270M (base) has no chat template: bench sends its prompts as plain text."""
    argv = ["bench", "--target", "gemma-3-270m", "--repeats", "1", "--max-tokens", "8", "--prompts", "chat"]
    code, out, err = run(capsys, *argv, "--modes", "copy", "--llama-baseline", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["raw_prompts"] and set(report["prompts"][0]["modes"]) == {"off", "copy", "llama"}
