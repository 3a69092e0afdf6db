"""Probability math of speculative sampling: pure numpy, no llama.cpp.

Target and draft go through the same `distribution()` so that p and q are the
*final* sampling distributions (after top-k / top-p / min-p / temperature), which
is what makes accept/resample exact (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import EdgespecError

INFILL_KEEP = 0.2  # llama.cpp's infill sampler drops text tokens less likely than this
INFILL_CANDIDATES = 64  # ... and works on at most this many (where no top-k limits them)


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults. temperature 0 means greedy; top_k 0, top_p 1 and
    min_p 0 switch those filters off. infill: llama.cpp's infill sampler after them
    (what llama.vscode asks for; see infill())."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    infill: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise EdgespecError(f"temperature must be >= 0, got {self.temperature}; use 0 for greedy")
        if self.top_k < 0:
            raise EdgespecError(f"top-k must be >= 0, got {self.top_k}; use 0 to switch it off")
        if not 0 < self.top_p <= 1:
            raise EdgespecError(f"top-p must be in (0, 1], got {self.top_p}; use 1 to switch it off")
        if not 0 <= self.min_p <= 1:
            raise EdgespecError(f"min-p must be in [0, 1], got {self.min_p}; use 0 to switch it off")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


DEFAULT = SamplingParams()  # the one source of the defaults (engine, command line, chat app)


class Vocabulary(Protocol):
    """What the infill sampler reads of a model's tokens (Model has it)."""

    eot: int

    def piece(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...


def distribution(logits: np.ndarray, params: SamplingParams, vocab: Vocabulary | None = None) -> np.ndarray:
    """Final sampling distribution over the vocabulary (float64, sums to 1).

    Filters run in llama.cpp's default chain order: top-k, top-p, min-p on the
    untempered logits, then temperature on the survivors, then (params.infill, which
    needs the model's `vocab`) the infill sampler."""
    logits = np.asarray(logits)
    if params.greedy:
        p = np.zeros(logits.shape[0])
        p[int(np.argmax(logits))] = 1.0
        return p
    n = logits.shape[0]
    k = params.top_k if 0 < params.top_k < n else n
    # candidate ids; argpartition keeps this O(V) for small k, and only top-p needs them sorted
    ids = np.argpartition(-logits, k - 1)[:k] if k < n else np.arange(n)
    z = logits[ids].astype(np.float64)
    if params.top_p < 1:
        order = np.argsort(-z, kind="stable")
        ids, z = ids[order], z[order]
        w = np.exp(z - z[0])
        # keep the smallest prefix whose mass reaches top_p (at least one token)
        keep = int(np.searchsorted(np.cumsum(w) / w.sum(), params.top_p)) + 1
        ids, z = ids[:keep], z[:keep]
    if params.min_p > 0:
        keep = np.exp(z - z.max()) >= params.min_p  # probability relative to the top token's
        ids, z = ids[keep], z[keep]
    w = np.exp((z - z.max()) / params.temperature)
    if params.infill:
        ids, w = infill(ids, w, vocab)
    p = np.zeros(n)
    p[ids] = w / w.sum()
    return p


def infill(ids: np.ndarray, w: np.ndarray, vocab: Vocabulary) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's infill sampler (llama_sampler_infill_apply) on candidates `ids` of
    weights w (their probabilities, unnormalised): which stay, with their weights (llama.cpp
    then draws in proportion to the survivors' own probabilities).
    - End-of-generation tokens together likelier than a third of an average text token's
      share (3·p_eog·n > p_txt): only they stay; the middle is done.
    - Else a token whose text starts another's is merged with it, the likelier keeping both
      probabilities (` foo` and ` foobar` are one choice); text tokens under INFILL_KEEP
      are dropped (none left: the end-of-turn token alone), then those under 1/(text
      tokens + 1) of what is left. A middle goes on only where the model is sure of it.
    Of more than INFILL_CANDIDATES candidates (no top-k), the likeliest that many."""
    if len(ids) > INFILL_CANDIDATES:
        top = np.argpartition(-w, INFILL_CANDIDATES - 1)[:INFILL_CANDIDATES]
        ids, w = ids[top], w[top]
    order = np.argsort(-w, kind="stable")  # llama.cpp walks them likeliest first
    ids, w = ids[order], w[order]
    p = w / w.sum()
    eog = np.array([vocab.is_eog(int(t)) for t in ids])
    if 3 * p[eog].sum() * len(ids) > p[~eog].sum():
        return ids[eog], w[eog]
    pieces = [vocab.piece(int(t)) for t in ids]
    at: dict[bytes, list[int]] = {}
    for i, piece in enumerate(pieces):
        at.setdefault(piece, []).append(i)
    longer: list[list[int]] = [[] for _ in pieces]  # longer[i]: the candidates whose text starts with i's
    for j, piece in enumerate(pieces):
        for end in range(1, len(piece) + 1):
            for i in at.get(piece[:end], ()):
                if i != j:
                    longer[i].append(j)
    gone = np.zeros(len(ids), dtype=bool)
    for i in range(len(ids)):
        for j in sorted(longer[i]):
            if gone[i]:
                break
            if not gone[j]:
                keep, drop = (j, i) if p[j] > p[i] else (i, j)
                p[keep] += p[drop]
                gone[drop] = True
    kept = ~gone & (eog | (p >= INFILL_KEEP))
    n_text = int((kept & ~eog).sum())
    if n_text == 0:
        return np.array([vocab.eot]), np.ones(1)
    p = np.where(kept, p, 0.0) / p[kept].sum()
    kept &= eog | (p >= 1 / (n_text + 1))
    return ids[kept], w[kept]


Allows = Callable[[np.ndarray], np.ndarray]  # token ids -> which of them a grammar lets come next
FIRST_LOOK = 256  # a grammar is asked about this many of the likeliest tokens first


def constrained(
    logits: np.ndarray, params: SamplingParams, allows: Allows, vocab: Vocabulary | None = None
) -> np.ndarray:
    """The law under a grammar: p_g ∝ p·1[allowed], p the final distribution (so top-k,
    top-p, min-p and temperature act as without a grammar, then what the grammar forbids
    is removed). Where the grammar forbids all of p's support, p_g is the distribution of
    the allowed tokens' logits alone. Only p's support is checked against the grammar,
    which is cheap (a full vocabulary takes llama.cpp 10-200 ms), unless that fallback is needed."""
    p = distribution(logits, params, vocab)
    support = np.flatnonzero(p)
    kept = support[allows(support)]
    if len(kept):
        p_g = np.zeros_like(p)
        p_g[kept] = p[kept]
        return p_g / p_g.sum()
    ids = allowed_top(logits, allows, 1 if params.greedy else params.top_k)
    masked = np.full(len(logits), -np.inf)
    masked[ids] = logits[ids]
    return distribution(masked, params, vocab)


def constrained_argmax(logits: np.ndarray, allows: Allows) -> int:
    """The argmax of p_g: the likeliest token the grammar allows (greedy decoding)."""
    best = int(np.argmax(logits))
    return best if allows(np.array([best]))[0] else int(allowed_top(logits, allows, 1)[0])


def allowed_top(logits: np.ndarray, allows: Allows, k: int) -> np.ndarray:
    """The k highest-logit token ids the grammar allows (all of them for k=0), asked
    about in descending order of logit, FIRST_LOOK first and then in growing chunks."""
    n = len(logits)
    first = np.argpartition(-logits, FIRST_LOOK - 1)[:FIRST_LOOK] if n > FIRST_LOOK else np.arange(n)
    order = first[np.argsort(-logits[first], kind="stable")]
    found = [order[allows(order)]]
    if k == 0 or sum(map(len, found)) < k:
        rest = np.setdiff1d(np.arange(n), first, assume_unique=True)
        rest = rest[np.argsort(-logits[rest], kind="stable")]
        start, chunk = 0, 4 * FIRST_LOOK
        while start < len(rest) and (k == 0 or sum(map(len, found)) < k):
            ids = rest[start : start + chunk]
            found.append(ids[allows(ids)])
            start, chunk = start + chunk, 4 * chunk
    allowed = np.concatenate(found)
    if not len(allowed):
        raise GrammarDeadEnd
    return allowed if k == 0 else allowed[:k]


class GrammarDeadEnd(EdgespecError):
    def __init__(self) -> None:
        super().__init__("the grammar allows no token after the answer so far: it cannot be completed; fix it")


def sample(p: np.ndarray, u: float) -> int:
    """The token id that the uniform draw u in [0, 1) picks from the distribution p
    (inverse CDF; p need not be normalised)."""
    cum = np.cumsum(p)
    return int(min(np.searchsorted(cum, u * cum[-1], side="right"), len(p) - 1))


def position_uniforms(seed: int, start: int, count: int) -> np.ndarray:
    """(count, 2) uniform draws for the sequence positions start, start+1, ...: column 0
    decides a draft token's acceptance, column 1 draws a token. They depend only on the
    seed and the position, so a seeded answer is the same however it was drafted."""
    return np.array([np.random.default_rng([seed, position]).random(2) for position in range(start, start + count)])


def acceptance_probability(p: np.ndarray, q: np.ndarray | None, x: int) -> float:
    """min(1, p(x)/q(x)); a deterministic draft (q None) is the point mass δx."""
    q_x = 1.0 if q is None else q[x]
    return min(1.0, p[x] / q_x) if q_x > 0 else 0.0


def residual_distribution(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """norm(max(p - q, 0)): where the next token comes from after x is rejected."""
    if q is None:
        r = p.copy()
        r[x] = 0.0  # max(p - δx, 0): x removed
    else:
        r = np.maximum(p - q, 0.0)
    total = r.sum()
    # total == 0 only if p == q up to rounding, where rejection has probability ~0: any draw from p is exact
    return r / total if total > 0 else p


def verify(
    draft: Sequence[int],
    q_rows: np.ndarray | None,
    p_row: Callable[[int], np.ndarray],
    uniforms: np.ndarray,
) -> tuple[int, int]:
    """Accept a draft left to right; return (number accepted, next token).

    draft: γ proposed token ids. q_rows: (γ, V) draft distributions, or None for a
    deterministic draft (point masses). p_row(i): the target's distribution (V,) at
    row i, conditioned on the context plus draft[:i]; asked for i = 0, 1, ... in order,
    only as far as verification goes. uniforms: (γ+1, 2) draws for those positions
    (see position_uniforms).

    Token x_i is accepted with probability min(1, p_i(x)/q_i(x)). At the first
    rejection the next token comes from norm(max(p_i - q_i, 0)) and the rest of
    the draft is dropped; if all γ pass, a bonus token is sampled from p_γ. The
    result is distributed exactly as the target alone (Leviathan et al., Thm 1).
    A point mass x is accepted exactly when the position's own draw from p_i is x
    (probability p_i(x), as the rule above, and otherwise that draw is the next
    token, from p_i without x): so copies never change a seeded answer.
    """
    for i, x in enumerate(draft):
        u_accept, u_draw = uniforms[i]
        p = p_row(i)
        if q_rows is None:
            if (token := sample(p, u_draw)) != x:
                return i, token
        elif u_accept >= acceptance_probability(p, q_rows[i], x):
            return i, sample(residual_distribution(p, q_rows[i], x), u_draw)
    return len(draft), sample(p_row(len(draft)), uniforms[len(draft)][1])


def verify_greedy(draft: Sequence[int], target_argmax: Callable[[int], int]) -> tuple[int, int]:
    """Greedy verification: accept while the draft equals the target's argmax.
    target_argmax(i) is the target's choice at row i (asked in order, as far as
    verification goes); the token after the accepted prefix is the target's own
    choice there (the correction, or the bonus token)."""
    for n, x in enumerate(draft):
        if (choice := target_argmax(n)) != x:
            return n, choice
    return len(draft), target_argmax(len(draft))
