"""Token healing: how far back a prompt's end is taken (a toy vocabulary), the tokens and law
while the answer owes that text, and on real SmolLM2 the healed answer against llama-cpp-python's
Llama given the text (greedy token for token; sampled, the first token's law), with and without
speculation."""

from __future__ import annotations

import numpy as np
import pytest
from reference import assert_greedy_as_llama, chi_square_pvalue, healed_law_after, reference_for

from edgespec import Engine
from edgespec.healing import Healed, Healing, Pieces, heal
from edgespec.sampling import SamplingParams
from edgespec.text import TextStream


class Toy:
    """A vocabulary of these token texts; token 0 is the end of generation (no text)."""

    texts = [b"", b" ", b" s", b" se", b" sel", b" self", b" select", b" return", b"x", b"a", b"b", b"ab", b"abc"]
    texts += [b"bc", b"."]
    n_vocab, eot = len(texts), 0

    def piece(self, token: int) -> bytes:
        return self.texts[token]

    def is_eog(self, token: int) -> bool:
        return token == 0


TOY = Toy()
PIECES = Pieces(TOY)


def ids(*texts: bytes) -> list[int]:
    return [Toy.texts.index(t) for t in texts]


@pytest.mark.parametrize(
    "tokens, start, healed",
    [
        ((b" return", b" sel"), 0, Healed(1, b" sel")),  # ` self` and ` select` begin with ` sel`
        ((b" return", b" self"), 0, Healed(2, b"")),  # no longer token begins with ` self`
        ((b"x", b"a", b"b"), 0, Healed(1, b"ab")),  # `bc` begins with `b`, `ab` and `abc` with `ab`, none with `xab`
        ((b"x", b"a", b"b"), 2, Healed(2, b"b")),  # not before `start` (an infill's middle)
        ((b"a", b"b"), 0, Healed(1, b"b")),  # one token stays
        ((b"", b"b"), 0, Healed(1, b"b")),  # never a special token
    ],
)
def test_how_far_back_a_prompt_is_healed(tokens, start, healed):
    assert heal(ids(*tokens), start, PIECES, TOY.piece) == healed


def test_while_the_text_is_owed_only_tokens_that_extend_or_begin_it_may_come():
    assert PIECES.allowed(b" sel").tolist() == ids(b" ", b" s", b" se", b" sel", b" self", b" select")
    healing = Healing(PIECES, b" sel", TOY.piece)
    assert healing.allowed_prefix(ids(b" se", b" sel")) == ids(b" se")  # then only `l...` may come
    assert healing.allowed_prefix(ids(b" self", b"x", b".")) == ids(b" self", b"x", b".")  # written: free
    healing.accept(ids(b" se")[0])
    assert healing.remaining == b"l" and not healing.done
    healing.accept(ids(b" self")[0] - 1)  # ` sel` is not `l`: an answer takes only what is allowed
    assert healing.done and healing.allows(np.arange(TOY.n_vocab)).all()


def test_the_law_while_the_text_is_owed_is_the_chain_on_the_allowed_tokens():
    logits = np.linspace(3.0, -3.0, TOY.n_vocab).astype(np.float32)
    logits[ids(b" select")] = 5.0  # the likeliest allowed, and of all
    healing = Healing(PIECES, b" sel", TOY.piece)
    assert healing.argmax(logits) == ids(b" select")[0]
    assert healing.law(logits, SamplingParams(temperature=0)).ids.tolist() == ids(b" select")
    allowed = ids(b" ", b" s", b" se", b" sel", b" self", b" select")
    p = healing.law(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)).dense(TOY.n_vocab)
    expected = np.zeros(TOY.n_vocab)
    expected[allowed] = np.exp(logits[allowed]) / np.exp(logits[allowed]).sum()  # p·1[allowed], renormalised
    assert np.allclose(p, expected)
    top2 = healing.law(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    assert top2.ids.tolist() == sorted(ids(b" ", b" select"))  # top-k among the allowed, not of all


def test_the_infill_samplers_end_of_turn_is_left_out_while_text_is_owed():
    """Six tokens extend `zz`, none begins another: none is sure enough for llama.cpp's infill
    sampler, which would end the middle, but the answer owes `zz`: the chain without it."""
    vocab = Toy()
    vocab.texts = [b"", b"x", *(b"zz" + bytes([c]) for c in b"abcdef")]
    vocab.n_vocab = len(vocab.texts)
    healing = Healing(Pieces(vocab), b"zz", vocab.piece)
    logits = np.zeros(vocab.n_vocab, dtype=np.float32)
    law = healing.law(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, infill=True), vocab)
    assert law.ids.tolist() == list(range(2, 8)) and np.allclose(law.probs, 1 / 6)


def test_the_text_returned_leaves_out_what_the_answer_wrote_again():
    stream = TextStream(skip=b" sel")
    assert [stream.push(b" se"), stream.push(b"lf.x"), stream.push(b" = 1")] == ["", "f.x", " = 1"]


# --- on SmolLM2, against llama-cpp-python's Llama ---------------------------------------

GREEDY_CASES = [
    ("The capital of Fra", b" Fra"),
    ("def fibonacci(n):\n    if n <= 1:\n        ret", b" ret"),
]


def healed_prompt(engine, prompt: str, healed: bytes) -> list[int]:
    """Llama's tokens of `prompt` less those that spell `healed` at its end."""
    reference = reference_for(engine.target)
    tokens = reference.prompt(prompt, raw=True)
    for k in range(1, len(tokens)):
        if b"".join(reference.pieces[t] for t in tokens[-k:]) == healed:
            return tokens[:-k]
    raise AssertionError(f"{healed!r} is not a run of {prompt!r}'s last tokens")


@pytest.fixture(scope="module")
def copy_engine(smollm2):
    return Engine(smollm2, None, draft_mode="copy", gamma=8)


@pytest.mark.parametrize("prompt, healed", GREEDY_CASES, ids=["word", "code"])
@pytest.mark.parametrize("mode", ["off", "copy", "model"])
def test_a_healed_greedy_answer_is_llamas_given_the_text(copy_engine, requant_engine, prompt, healed, mode):
    """The answer is Llama's after the prompt less its healed end, its first tokens the likeliest of
    those the text allows, and it returns only what follows the text; drafts change nothing."""
    engine = requant_engine if mode == "model" else copy_engine
    options = dict(raw=True, heal=True, temperature=0, max_tokens=24, draft_mode=mode)
    plain = engine.generate(prompt, **(options | {"draft_mode": "off"}))
    answer = engine.generate(prompt, **options, prediction=plain.text if mode == "copy" else None)
    assert answer.stats.healed_bytes == len(healed) and answer.tokens == plain.tokens
    if mode != "off":
        assert answer.stats.accepted > 0, answer.stats.as_dict()
    tokens = healed_prompt(engine, prompt, healed)
    assert answer.stats.n_prompt == len(tokens)
    assert_greedy_as_llama(f"healed {mode}", engine, tokens, answer.tokens, limit=24, healed=healed)
    written = b"".join(map(engine.target.piece, answer.tokens))
    assert written.startswith(healed) and answer.text == written[len(healed) :].decode()


def test_healing_is_only_asked_for(copy_engine):
    """A raw prompt is healed only when asked (Request.heal): the default is Llama's plain answer."""
    prompt, healed = GREEDY_CASES[0]
    plain = copy_engine.generate(prompt, raw=True, temperature=0, max_tokens=8)
    assert plain.stats.healed_bytes == 0
    assert_greedy_as_llama("unhealed", copy_engine, prompt, plain.tokens, raw=True, limit=8)


SPREAD = "She said that she would go to the st"  # the text allows ` `, ` state`, ` store`, ` stadium`, ...
CHAIN = dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05)


@pytest.mark.parametrize("mode", ["model", "copy"])
@pytest.mark.slow
def test_the_first_healed_token_follows_llamas_law_given_the_text(requant_engine, copy_engine, mode):
    """Sampled through drafts accepted and rejected: the first token's law is llama.cpp's chain on
    Llama's logits of the tokens the text allows (its top-k among them, not among all)."""
    engine, gamma = (requant_engine, 4) if mode == "model" else (copy_engine, 8)
    prediction = "ate of the art." if mode == "copy" else None  # the text after the prompt, as the answer's
    tokens = healed_prompt(engine, SPREAD, b" st")
    p = healed_law_after(engine, tokens, b" st", width=gamma + 1, **CHAIN)
    runs, counts, sources = 1000, np.zeros(len(p)), set()
    rng = np.random.default_rng(7)
    for _ in range(runs):
        seed = int(rng.integers(2**32))
        options = dict(raw=True, heal=True, draft_mode=mode, gamma=gamma, max_tokens=4, prediction=prediction)
        events = engine.stream(SPREAD, seed=seed, **options, **CHAIN)
        first = next(events)
        events.close()
        counts[first.token] += 1
        sources.add(first.source)
    assert sources == {"draft", "target"}
    assert chi_square_pvalue(counts, p, runs) > 0.01
