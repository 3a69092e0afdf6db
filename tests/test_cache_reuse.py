"""llama-server's --cache-reuse (`load(cache_reuse=N)`, `edgespec serve --cache-reuse N`): an editor's
ring of snippets that drops its oldest and adds a new one costs the new one and what follows it,
not the snippets after the dropped one again, in the target's cache and the draft model's. The
answers are read from moved cells, which are not what a fresh read computes (they were read after
the dropped text): they are judged close to a fresh read's, not equal to Llama's."""

from __future__ import annotations

import inspect
import textwrap

import httpx
import pytest

import edgespec
from edgespec import EdgespecError

REUSE = 32  # tokens a cached run must have to be moved
LINES = inspect.getsource(textwrap).splitlines(keepends=True)
# six snippets of a file, as llama.vim's ring has them (each tokenized on its own, as the FIM layout reads them)
SNIPPETS = [f"# snippet {i}\n" + "".join(LINES[at : at + 8]) for i, at in enumerate(range(60, 108, 8))]
TAIL = "\ndef add(a, b):\n    return a +"


def ring(first: int, last: int) -> str:
    """The prompt with the ring's snippets first..last-1 before the code at the cursor."""
    return "".join(SNIPPETS[first:last]) + TAIL


@pytest.fixture
def reusing(self_engine):
    for model in self_engine.models:
        model.cache.reuse = REUSE
    yield self_engine
    for model in self_engine.models:
        model.cache.reuse = 0
        model.cache.truncate(0)


def answer(engine, prompt: str):
    return engine.generate(prompt, raw=True, max_tokens=4, temperature=0, logprobs=3)


def test_a_ring_that_drops_its_oldest_snippet_reads_only_the_new_one_and_what_follows(reusing):
    answer(reusing, ring(0, 5))
    moved = answer(reusing, ring(1, 6))
    new = len(reusing.prompt_tokens(SNIPPETS[5] + TAIL, raw=True))
    assert moved.stats.n_prompt - moved.stats.n_prompt_cached <= new + 2, (moved.stats.n_prompt_cached, new)
    draft = reusing.draft_model
    assert draft.tokens == reusing.target.tokens[: len(draft.tokens)] and len(draft.tokens) >= moved.stats.n_prompt - 1
    for model in reusing.models:  # a fresh read of the same prompt, to compare with
        model.cache.truncate(0)
    fresh = answer(reusing, ring(1, 6))
    assert fresh.stats.n_prompt_cached == 0
    # moved cells answer as a fresh read does, up to what reading after the dropped snippet changed
    assert moved.tokens[:2] == fresh.tokens[:2], (moved.text, fresh.text)
    assert abs(moved.logprobs[0].logprob - fresh.logprobs[0].logprob) < 0.5


def test_without_reuse_the_ring_is_read_again_from_the_dropped_snippet(self_engine):
    answer(self_engine, ring(0, 5))
    again = answer(self_engine, ring(1, 6))
    assert again.stats.n_prompt_cached < 8  # what the two rings share: "# snippet "


def test_a_recurrent_model_refuses_cache_reuse_in_one_line(tmp_path, smollm2_path):
    from tiny_models import write_tiny

    mamba = write_tiny(tmp_path / "mamba.gguf", "mamba", smollm2_path)
    with pytest.raises(EdgespecError, match="cannot be shifted.*drop --cache-reuse"):
        edgespec.load(target=str(mamba), n_ctx=256, cache_ram=0, cache_reuse=REUSE, progress=False)
    with pytest.raises(EdgespecError, match="number of tokens"):
        edgespec.load(target=str(mamba), cache_reuse=-1, progress=False)


def test_serve_with_cache_reuse_reads_only_the_new_snippet(smollm2):
    """`edgespec serve --cache-reuse N`, as llama.vim's setup runs llama-server: its timings say so."""
    from test_server import Server

    # no prompt cache: one saved by an earlier run would hold the second ring already
    server = Server("--target", "smollm2-135m", "--ctx", "1024", "--cache-ram", "0", "--cache-reuse", str(REUSE))
    try:
        completion = server.url.removesuffix("/v1") + "/completion"
        for first in (0, 1):
            reply = httpx.post(completion, json={"prompt": ring(first, first + 5), "n_predict": 2}, timeout=120)
            assert reply.status_code == 200, reply.text
        new = len(smollm2.tokenize(SNIPPETS[5] + TAIL, add_special=False, parse_special=False))
        assert reply.json()["timings"]["prompt_n"] <= new + 2, reply.json()["timings"]
    finally:
        assert server.stop() == 0
