"""Independent references for the exactness tests, built from nothing the engine computes:
llama-cpp-python's own Llama (its tokenizer, its chat formatter, its evaluation; greedy is the
argmax of its rows, one token a pass as it generates) and llama.cpp's sampling chain written out
here from raw logits (checked against llama.cpp's own samplers in test_reference.py). From
edgespec only plain_llama is used: Llama itself, on the kernels the engine's model runs (repacked
ones crash on some CPUs).

The float bound. llama.cpp's CPU kernels round a pass of several tokens (a verify pass) otherwise
than a one-token pass (a plain step, and each of the reference's steps), so where a position's
top two logits are closer than that rounding, the speculative answer may take the other one.
Measured on a 2-core AMD EPYC with `batch_noise` on the answers of these tests (passes of 2 to 65
tokens against one-token passes, the change in the gap between each position's top two tokens):
SmolLM2-135M without flash attention 0.42 (logits up to 1.27 apart), with flash attention 0.0;
Qwen2.5-Coder-1.5B 0.20-0.29. The bound is not assumed: it is measured on the reference's own
answer when an answer diverges, and a divergence is excused only where the reference's gap between
its token and ours is below it: from there the reference continues after our token, and must agree
to the end but for such near-ties, MAX_NEAR_TIES of them at most (a 34-token answer of SmolLM2
without flash attention, verified in passes of 9, was seen to cross two)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from scipy import stats as scipy_stats

from edgespec.kernels import plain_llama

WIDTHS = (2, 5, 9, 17, 33, 65)  # verify passes: gamma + 1, up to a copy of 64
excused: list[str] = []  # each excused divergence, for the end of the test run
MAX_NEAR_TIES = 3  # excused divergences in one answer


@dataclass
class Reference:
    """llama-cpp-python's Llama on one model file, set up as the engine's model is."""

    llm: Llama
    noise: dict[tuple, float] = field(default_factory=dict)
    answers: dict[tuple, list[int]] = field(default_factory=dict)  # greedy() from the prompt alone, by its arguments
    _pieces: list[bytes] | None = None

    @property
    def vocab(self):
        return llama_cpp.llama_model_get_vocab(self.llm.model)

    def prompt(self, text: str | list[dict], raw: bool) -> list[int]:
        """The tokens of a raw prompt, or of a conversation (a string: one user message) in the
        file's own chat template, rendered by llama-cpp-python's Jinja formatter, not ours."""
        llm = self.llm
        template = llm.metadata.get("tokenizer.chat_template")
        if not raw and template:
            bos = llm.detokenize([llm.token_bos()], special=True).decode() if llm.token_bos() >= 0 else ""
            eos = llm.detokenize([llm.token_eos()], special=True).decode()
            messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
            text = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)(messages=messages).prompt
            return llm.tokenize(text.encode(), add_bos=not (bos and text.startswith(bos)), special=True)
        return llm.tokenize(text.encode(), add_bos=True, special=True)

    def greedy(
        self, prompt: list[int], limit: int, given: list[int] = (), gbnf: str | None = None, healed: bytes = b""
    ) -> list[int]:
        """Llama's greedy answer after `prompt` and the tokens `given` (kept as they are): up to
        `limit` tokens in all, ending before an end-of-generation token; under a GBNF grammar,
        the likeliest token it allows (llama.cpp's grammar sampler, as Llama uses it); after a
        prompt healed of `healed`, the likeliest of the tokens the text allows (healed_tokens) until
        the answer has written it. Its rows stay in llm.scores (row len(prompt) - 1 + i chose token i)."""
        llm, answer = self.llm, list(given)
        grammar = GrammarMask(self.vocab, gbnf) if gbnf else None
        for token in answer if grammar else ():
            grammar.accept(token)
        owed = self.owed(healed, answer)
        self.hold(prompt + answer)
        while len(answer) < limit:
            row = llm.scores[llm.n_tokens - 1]
            if owed:
                allowed = self.healed_tokens(owed)
                token = int(allowed[np.argmax(row[allowed])])
            else:
                token = int(np.argmax(row)) if grammar is None else grammar.likeliest(row)
            if llama_cpp.llama_vocab_is_eog(self.vocab, token):
                break
            answer.append(token)
            owed = self.owed(owed, [token])
            if grammar:
                grammar.accept(token)
            llm.eval([token])
        return answer

    def hold(self, tokens: list[int]) -> None:
        """Llama's cache holding `tokens`, evaluated from what it held of them, as Llama.generate
        reuses its cache (a 2,000-token fill-in-the-middle prompt is read once), the last token
        always evaluated again, for its row."""
        llm, held = self.llm, self.llm._input_ids.tolist()
        keep = 0
        while keep < min(len(held), len(tokens) - 1) and held[keep] == tokens[keep]:
            keep += 1
        if keep and llm._ctx.kv_cache_seq_rm(-1, keep, -1):
            llm.n_tokens = keep
        else:
            llm.reset()
        llm.eval(tokens[llm.n_tokens :])

    @property
    def pieces(self) -> list[bytes]:
        """Each token's text as Llama detokenizes it (b"" for end-of-generation tokens)."""
        if self._pieces is None:
            llm, vocab = self.llm, self.vocab
            self._pieces = [
                b"" if llama_cpp.llama_vocab_is_eog(vocab, t) else llm.detokenize([t]) for t in range(llm.n_vocab())
            ]
        return self._pieces

    def healed_tokens(self, owed: bytes) -> np.ndarray:
        """The tokens that may come while an answer owes `owed` (a healed prompt's text): those whose
        text begins with it, or is a beginning of it, found by walking the whole vocabulary."""
        pieces = enumerate(self.pieces)
        return np.array([t for t, piece in pieces if piece and (piece.startswith(owed) or owed.startswith(piece))])

    def owed(self, owed: bytes, tokens: list[int]) -> bytes:
        """What an answer still owes of a healed prompt's text after `tokens`."""
        for token in tokens:
            piece = self.pieces[token]
            owed = owed[len(piece) :] if owed.startswith(piece) else b""
        return owed

    @property
    def ends(self) -> list[int]:
        """The end-of-generation tokens."""
        return [t for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(self.vocab, t)]

    def row(self, prompt: list[int], i: int) -> np.ndarray:
        """The logits that chose token i of the last greedy() answer."""
        return self.llm.scores[len(prompt) - 1 + i]

    def batch_noise(self, prompt: list[int], answer: list[int]) -> float:
        """How far passes of each verify width move the gap between each position's top two
        tokens from one-token passes' (0 where llama.cpp's kernels round alike)."""
        key = (tuple(prompt), tuple(answer))
        if key not in self.noise:
            llm, n, inputs = self.llm, len(answer), prompt[-1:] + answer[:-1]  # row i chose answer[i]
            llm.reset()
            llm.eval(prompt[:-1])
            for token in inputs:
                llm.eval([token])
            single = np.array(llm.scores[len(prompt) - 1 : len(prompt) - 1 + n])
            top = np.argsort(-single, axis=1)[:, :2]
            rows = np.arange(n)

            def gaps(scores):
                return scores[rows, top[:, 0]] - scores[rows, top[:, 1]]

            worst = 0.0
            for width in WIDTHS:
                llm.reset()
                llm.eval(prompt[:-1])
                for at in range(0, n, width):
                    llm.eval(inputs[at : at + width])
                batched = np.array(llm.scores[len(prompt) - 1 : len(prompt) - 1 + n])
                worst = max(worst, float(np.abs(gaps(batched) - gaps(single)).max()))
            self.noise[key] = worst
        return self.noise[key]


class GrammarMask:
    """llama.cpp's grammar sampler on a whole vocabulary: which tokens may come next."""

    def __init__(self, vocab, gbnf: str) -> None:
        self.sampler = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        assert self.sampler, "the grammar does not parse"

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        data = np.zeros(len(ids), dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        data["id"] = ids
        pointer = data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
        array = llama_cpp.llama_token_data_array(data=pointer, size=len(data), selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self.sampler, ctypes.byref(array))
        return data["logit"] != -np.inf

    def likeliest(self, row: np.ndarray) -> int:
        """The allowed token of highest logit: the likeliest first, a few at a time (asking the
        grammar about the whole vocabulary each step takes seconds)."""
        order = np.argsort(-row, kind="stable")
        for start, end in ((0, 64), (64, 4096), (4096, len(order))):
            allowed = self.allowed(order[start:end])
            if allowed.any():
                return int(order[start + int(np.argmax(allowed))])
        raise AssertionError("the grammar allows no token")

    def accept(self, token: int) -> None:
        llama_cpp.llama_sampler_accept(self.sampler, token)

    def __del__(self) -> None:
        llama_cpp.llama_sampler_free(self.sampler)


_references: dict[tuple, Reference] = {}


def reference_for(model) -> Reference:
    """The reference for an engine's target (one per file and setting, kept for the session)."""
    key = (str(model.path), model.repack, model.flash_attn, model.n_threads, model.n_ctx, model.n_batch)
    if key not in _references:
        llm = plain_llama(
            model.path, model.repack, n_ctx=model.n_ctx, n_batch=model.n_batch, n_ubatch=model.n_batch,
            n_threads=model.n_threads, n_threads_batch=model.n_threads, flash_attn=model.flash_attn,
            logits_all=True, verbose=False,
        )  # fmt: skip
        _references[key] = Reference(llm)
    return _references[key]


def assert_greedy_as_llama(
    name: str,
    engine,
    prompt: str | list[dict] | list[int],
    ours: list[int],
    *,
    raw: bool = False,
    limit: int | None = None,
    gbnf: str | None = None,
    healed: bytes = b"",
) -> None:
    """A greedy answer's tokens `ours` from `engine` are llama-cpp-python's greedy answer token for
    token, but for divergences at float near-ties (see the module's docstring).
    prompt: text (raw, or one user message), a conversation, or tokens as given (a fill-in-the-middle
    prompt); text is tokenized by Llama and must give the engine's tokens. limit: the request's
    max_tokens (default: the answer's length); gbnf: the grammar it was under; healed: the text the
    prompt (tokens, healed) was healed of."""
    reference = reference_for(engine.target)
    if prompt and isinstance(prompt[0], int):
        tokens = list(prompt)
    else:
        tokens = reference.prompt(prompt, raw)
        assert engine.prompt_tokens(prompt, raw=raw) == tokens, f"{name}: the prompt is not tokenized as Llama does"
    limit = len(ours) if limit is None else limit
    key = (tuple(tokens), limit, gbnf, healed)
    if reference.answers.get(key) == ours:  # Llama's answer to this request, found before (several modes' tests)
        return
    agreed = 0  # the tokens of ours the reference continues after (up to the last near-tie)
    for _ in range(MAX_NEAR_TIES + 1):
        expected = reference.greedy(tokens, limit, given=ours[:agreed], gbnf=gbnf, healed=healed)
        if not agreed:
            reference.answers[key] = expected
        first = next((i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b), None)
        if first is None and len(ours) >= len(expected):
            assert len(ours) == len(expected), f"{name}: {len(ours)} tokens where Llama answers {len(expected)}"
            return
        row = reference.row(tokens, first if first is not None else len(ours))
        if first is None:  # ours ended where Llama goes on: its end-of-generation token against Llama's
            first = len(ours)
            gap = float(row[expected[first]] - row[reference.ends].max())
            bound = reference.batch_noise(tokens, expected[: first + 1])
            assert gap < bound, f"{name}: ends at token {first} where Llama goes on (gap {gap:.4f})"
            excused.append(f"{name}: its end at token {first}, gap {gap:.4f} < noise {bound:.4f}")
            return
        gap = float(row[expected[first]] - row[ours[first]])
        bound = reference.batch_noise(tokens, expected[: first + 1])
        at = f"{name}: diverges from Llama at token {first}"
        assert gap < bound, f"{at}, logit gap {gap:.4f} (float noise {bound:.4f})"
        excused.append(f"{name}: token {first}/{len(ours)}, gap {gap:.4f} < noise {bound:.4f}")
        agreed = first + 1
    raise AssertionError(f"{name}: diverges from Llama at more than {MAX_NEAR_TIES} near-ties")


def law_after(engine, prompt: str, given: list[int] = (), *, width: int, raw: bool = True, gbnf=None, **chain):
    """The target's sampling law for the token after `prompt` and `given`, dense: Llama's logits
    there, from a pass of `width` tokens (shaped as the verify pass that scores it: see the module's
    docstring), through chain_law; under a GBNF grammar, constrained_chain_law."""
    reference = reference_for(engine.target)
    tokens = reference.prompt(prompt, raw)
    assert engine.prompt_tokens(prompt, raw=raw) == tokens, "the prompt is not tokenized as Llama does"
    tokens += given
    llm = reference.llm
    llm.reset()
    llm.eval(tokens[:-1])
    llm.eval(tokens[-1:] * width)
    logits = np.array(llm.scores[len(tokens) - 1])
    if gbnf is None:
        return chain_law(logits, **chain)
    grammar = GrammarMask(reference.vocab, gbnf)
    for token in given:
        grammar.accept(token)
    return constrained_chain_law(logits, grammar, **chain)


def constrained_chain_law(logits: np.ndarray, grammar: GrammarMask, **chain) -> np.ndarray:
    """The law under a grammar: p_g ∝ p·1[allowed] (the chain acts as without a grammar, then what
    the grammar forbids is removed); where it forbids all of p's support, the chain on the allowed
    tokens' logits alone."""
    p = chain_law(logits, **chain)
    support = np.flatnonzero(p)
    kept = np.zeros_like(p)
    kept[support] = np.where(grammar.allowed(support), p[support], 0.0)
    if kept.sum() > 0:
        return kept / kept.sum()
    return chain_law(np.where(grammar.allowed(np.arange(len(logits))), logits, -np.inf), **chain)


def assert_first_token_law(engine, prompt: str, params: dict, gamma: int | str, runs: int, **request) -> int:
    """The first token of `runs` seeded answers follows the target's law from the reference
    (law_after; chi-square), drawn through drafts accepted and resampled: both paths must be taken.
    Returns in how many runs a tree's sibling was taken (a sampled tree's law is judged where they were)."""
    # the verify pass that scores it is gamma + 1 wide (auto's varies: one that checks a single token)
    p = law_after(engine, prompt, width=gamma + 1 if isinstance(gamma, int) else 2, **params)
    counts, sources, siblings_taken = np.zeros(len(p)), set(), 0
    rng = np.random.default_rng(123)
    for _ in range(runs):
        seed = int(rng.integers(2**32))
        run = engine.start(prompt, raw=True, gamma=gamma, max_tokens=8, seed=seed, **params, **request)
        events = engine.events(run)
        first = next(events)
        events.close()
        counts[first.token] += 1
        sources.add(first.source)
        siblings_taken += any(trust.taken for trust in run.controller.siblings.values())
    assert sources == {"draft", "target"}, sources  # both paths (accepted draft, resampled) were exercised
    assert chi_square_pvalue(counts, p, runs) > 0.01
    return siblings_taken


def chi_square_pvalue(counts: np.ndarray, p: np.ndarray, runs: int) -> float:
    """Pearson's test of `runs` draws counted in `counts` against the law p (same shape); outcomes
    expected fewer than 5 times are pooled into one bin, so that the test is valid."""
    expected = p * runs
    big = expected >= 5
    observed_bins, expected_bins = np.r_[counts[big], counts[~big].sum()], np.r_[expected[big], expected[~big].sum()]
    if expected_bins[-1] == 0:
        assert observed_bins[-1] == 0, "drawn where the law gives probability 0"
        observed_bins, expected_bins = observed_bins[:-1], expected_bins[:-1]
    assert len(expected_bins) >= 2, f"one outcome: nothing to test ({expected_bins})"
    return scipy_stats.chisquare(observed_bins, expected_bins).pvalue


def chain_law(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """llama.cpp's default chain the plain way, over the whole vocabulary sorted: top-k, top-p
    (the fewest likeliest tokens whose mass reaches top_p), min-p (p >= min_p * p_max), then
    temperature on the survivors' logits. Dense, float64."""
    order = np.argsort(-logits, kind="stable")
    z = logits[order].astype(np.float64)
    if 0 < top_k < len(z):
        order, z = order[:top_k], z[:top_k]
    w = np.exp(z - z[0])
    keep = int(np.searchsorted(np.cumsum(w) / w.sum(), top_p)) + 1 if top_p < 1 else len(z)
    order, z = order[:keep], z[:keep]
    kept = np.exp(z - z[0]) >= min_p
    w = np.exp((z[kept] - z[0]) / temperature)
    p = np.zeros(len(logits))
    p[order[kept]] = w / w.sum()
    return p


def healed_law_after(engine, tokens: list[int], healed: bytes, *, width: int, **chain) -> np.ndarray:
    """The target's law for the first token after a prompt healed of `healed` (tokens: the prompt
    as healed), dense: Llama's logits there, from a pass of `width` tokens (shaped as the verify
    pass that scores it), the tokens the text does not allow (Reference.healed_tokens) removed, and
    llama.cpp's chain on the rest (chain_law)."""
    reference = reference_for(engine.target)
    llm = reference.llm
    llm.reset()
    llm.eval(tokens[:-1])
    llm.eval(tokens[-1:] * width)
    logits = np.array(llm.scores[len(tokens) - 1])
    allowed = reference.healed_tokens(healed)
    masked = np.full(len(logits), -np.inf)
    masked[allowed] = logits[allowed]
    return chain_law(masked, **chain)
