"""Repeat, frequency and presence penalties and logit_bias (SamplingParams.penalties): each
verified row penalised for the answer's tokens before it, drafted ones included. Greedy answers
are llama-cpp-python's Llama's with the same penalties (its own sampler chain); a sampled answer
keeps the penalised law (chi-square); the server reads the fields of each API and refuses the
samplers edgespec does not run."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from conftest import TINY_TEMPERATURE
from llama_cpp import LogitsProcessorList
from reference import chain_law, chi_square_pvalue, law_after, reference_for
from test_server import Server

from edgespec import Penalties, Request
from edgespec.errors import EdgespecError
from edgespec.server.api_body import sampling_of

PROMPT = "Repeat after me: apple banana apple banana apple banana apple banana"
LENGTH = 40


def llama_greedy(engine, penalties: Penalties) -> list[int]:
    """Llama's greedy answer to PROMPT under `penalties` (its penalties sampler, last_n_tokens_size
    as the window, the bias as a logits processor, as create_completion's logit_bias)."""
    reference = reference_for(engine.target)
    llm, tokens = reference.llm, reference.prompt(PROMPT, raw=True)
    bias = dict(penalties.bias)

    def biased(_, scores):
        scores = np.copy(scores)
        for token, added in bias.items():
            scores[token] += added
        return scores

    llm.last_n_tokens_size = penalties.last_n
    out = []
    steps = llm.generate(
        tokens,
        temp=0,
        repeat_penalty=penalties.repeat,
        frequency_penalty=penalties.frequency,
        presence_penalty=penalties.presence,
        logits_processor=LogitsProcessorList([biased]) if bias else None,
        reset=True,
    )
    for token in steps:
        if llm.token_eos() == token or len(out) == LENGTH:
            break
        out.append(token)
    llm.last_n_tokens_size = 64
    return out


def test_greedy_penalised_answers_are_llamas(self_engine):
    """SmolLM2 drafting for itself (drafts accepted, verified in passes of several rows): the
    penalised greedy answer is Llama's, and not the unpenalised one."""
    plain = self_engine.generate(PROMPT, raw=True, temperature=0, max_tokens=LENGTH)
    assert plain.tokens == llama_greedy(self_engine, Penalties())
    for penalties in (
        Penalties(repeat=1.3, frequency=0.4, presence=0.3),
        Penalties(repeat=1.5, last_n=8),
        Penalties(bias=((plain.tokens[0], -100.0), (plain.tokens[1], -np.inf))),
    ):
        answer = self_engine.generate(PROMPT, raw=True, temperature=0, max_tokens=LENGTH, penalties=penalties)
        assert answer.tokens == llama_greedy(self_engine, penalties) and answer.tokens != plain.tokens, penalties
        assert answer.stats.accepted > 0  # rows after drafted tokens were penalised for them


def penalised(logits: np.ndarray, answer: list[int], penalties: Penalties) -> np.ndarray:
    """llama.cpp's logit bias, then its penalties sampler, the plain way (float32)."""
    z = np.array(logits, dtype=np.float32)
    for token, added in penalties.bias:
        z[token] += np.float32(added)
    for token in set(answer[-penalties.last_n :]):
        count = answer[-penalties.last_n :].count(token)
        z[token] = z[token] * penalties.repeat if z[token] <= 0 else z[token] / np.float32(penalties.repeat)
        z[token] -= np.float32(count * penalties.frequency + penalties.presence)
    return z


def test_a_sampled_answers_second_token_keeps_the_penalised_law(tiny_engine):
    """A tiny target drafted by a perturbed copy (q != p, drafts accepted and resampled): a token
    x likely first and among the likeliest after itself, biased up to come first often; among
    seeded answers that began with x, the second token follows the law after x with x penalised
    (a strong repeat penalty, presence and frequency) and the bias."""
    params = dict(temperature=TINY_TEMPERATURE, top_k=20, top_p=1.0, min_p=0.0)
    first_law = law_after(tiny_engine, "cat", width=4, **params)
    after = {int(t): _logits_after(tiny_engine, "cat", [int(t)]) for t in np.argsort(-first_law)[:20]}
    x = next(t for t, z in after.items() if (z > z[t]).sum() < 10)
    penalties = Penalties(repeat=4.0, presence=2.0, frequency=1.0, bias=((x, 9.0),))
    runs, seconds, sources = 1500, np.zeros(tiny_engine.target.n_vocab), set()
    rng = np.random.default_rng(7)
    for _ in range(runs):
        seed = int(rng.integers(2**32))
        # (3 tokens: a round may draft the second, 2 would leave room for a draft of one)
        request = Request.of("cat", raw=True, max_tokens=3, seed=seed, penalties=penalties, **params)
        events = [e for e in tiny_engine.events(tiny_engine.start(request)) if e.token is not None]
        if len(events) >= 2 and events[0].token == x:
            seconds[events[1].token] += 1
            sources.add(events[1].source)
    p = chain_law(penalised(after[x], [x], penalties), **params)
    assert seconds.sum() > 300 and sources == {"draft", "target"}  # accepted drafts, and resampled tokens
    unpenalised = chain_law(penalised(after[x], [], penalties), **params)  # (the bias alone)
    assert p[x] < unpenalised[x] / 2  # the penalties moved the law where it is sampled
    assert chi_square_pvalue(seconds, p, int(seconds.sum())) > 0.01


def _logits_after(engine, prompt: str, given: list[int]) -> np.ndarray:
    reference = reference_for(engine.target)
    tokens = reference.prompt(prompt, raw=True) + given
    reference.llm.reset()
    reference.llm.eval(tokens)
    return np.array(reference.llm.scores[len(tokens) - 1])


def test_penalties_are_checked():
    with pytest.raises(EdgespecError, match="repeat penalty must be > 0"):
        Penalties(repeat=0)
    with pytest.raises(EdgespecError, match="window must be >= 0"):
        Penalties(last_n=-2)


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"presence_penalty": 0.5, "frequency_penalty": 0.25}, Penalties(presence=0.5, frequency=0.25)),
        ({"repeat_penalty": 1.1, "repeat_last_n": 32}, Penalties(repeat=1.1, last_n=32)),
        ({"logit_bias": {"42": -100, "7": 5}}, Penalties(bias=((42, -100.0), (7, 5.0)))),  # OpenAI's
        ({"logit_bias": [[42, False], [7, 1.5]]}, Penalties(bias=((42, -np.inf), (7, 1.5)))),  # llama-server's
    ],
)
def test_the_fields_of_each_api_are_read(body, expected):
    assert sampling_of(body).penalties == expected


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    assert s.stop() == 0


def test_a_server_answers_with_penalties_and_refuses_what_it_cannot_run(server, self_engine):
    """Through the OpenAI client and llama-server's /completion: the penalised greedy answer is
    Llama's; a sampler edgespec does not run (mirostat, DRY, XTC, typical-p), switched on, and a
    bias on a token the model does not have are 400s naming the field."""
    penalties = Penalties(repeat=1.3, frequency=0.4, presence=0.3)
    expected = reference_for(self_engine.target).llm.detokenize(llama_greedy(self_engine, penalties)).decode()
    root = server.url.removesuffix("/v1")
    body = {"prompt": PROMPT, "n_predict": LENGTH, "temperature": 0, "heal": False}
    body |= {"repeat_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}
    native = httpx.post(root + "/completion", json=body, timeout=60).json()
    completion = server.client().completions.create(
        model="m",
        prompt=PROMPT,
        max_tokens=LENGTH,
        temperature=0,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        extra_body={"repeat_penalty": 1.3},
    )
    assert native["content"] == completion.choices[0].text == expected
    for field, value in [("mirostat", 2), ("dry_multiplier", 0.8), ("xtc_probability", 0.5), ("typical_p", 0.9)]:
        refused = httpx.post(root + "/completion", json=body | {field: value}, timeout=60)
        assert refused.status_code == 400 and f"'{field}' is not supported" in refused.json()["error"]["message"]
    huge = server.post("/completions", json={"model": "m", "prompt": "Hi", "logit_bias": {"999999": 1}})
    assert huge.status_code == 400 and "token id 999999 is not in the model's vocabulary" in huge.text
