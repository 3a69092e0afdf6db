"""Probability math of speculative sampling: pure numpy, no llama.cpp.

Target and draft go through the same `law()` so that p and q are the *final*
sampling distributions (after top-k / top-p / min-p / temperature), which is what
makes accept/resample exact (Leviathan et al. 2023, Chen et al. 2023). A law is
kept on its support (a few dozen tokens with llama.cpp's default filters), found
without sorting the vocabulary: a round's Python stays far below a GPU's step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import EdgespecError
from .vocabulary import Vocabulary

INFILL_KEEP = 0.2  # llama.cpp's infill sampler drops text tokens less likely than this
INFILL_CANDIDATES = 64  # ... and works on at most this many (where no top-k limits them)


@dataclass(frozen=True)
class Penalties:
    """What llama-cpp-python's Llama does to a row's logits before its chain: `bias` added to
    chosen tokens' logits (-inf: never), then llama.cpp's penalties sampler over the answer's last
    `last_n` tokens (Llama's last_n_tokens_size; the prompt's are not counted, as Llama's sampler
    accepts only the tokens it samples): a token seen c times there has its logit multiplied by
    `repeat` where <= 0, divided by it where > 0, then lowered by c * frequency + presence. In
    float32, as llama.cpp computes them."""

    repeat: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    last_n: int = 64
    bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)

    def __post_init__(self) -> None:
        if not self.repeat > 0:
            raise EdgespecError(f"the repeat penalty must be > 0, got {self.repeat}; use 1 to switch it off")
        if self.last_n < 0:
            raise EdgespecError(f"the penalties' window must be >= 0 tokens, got {self.last_n}")

    def check(self, n_vocab: int) -> None:
        """EdgespecError where the bias names a token the vocabulary does not have."""
        if bad := next((t for t, _ in self.bias if not 0 <= t < n_vocab), None):
            raise EdgespecError(f"logit_bias: token id {bad} is not in the model's vocabulary (0..{n_vocab - 1})")

    @property
    def counts_tokens(self) -> bool:
        """Whether the tokens in the window change a row (else only the bias does)."""
        return self.last_n > 0 and (self.repeat != 1 or self.frequency != 0 or self.presence != 0)

    @property
    def active(self) -> bool:
        return self.counts_tokens or bool(self.bias)

    def apply(self, logits: np.ndarray, answer: Sequence[int]) -> np.ndarray:
        """The row's logits penalised for the answer's tokens before it (a copy)."""
        z = np.array(logits, dtype=np.float32)
        if self.bias:
            ids, added = zip(*self.bias, strict=True)
            z[list(ids)] += np.array(added, dtype=np.float32)
        window = answer[-self.last_n :] if self.counts_tokens else ()
        if len(window):
            ids, counts = np.unique(np.asarray(window), return_counts=True)
            seen, repeat = z[ids], np.float32(self.repeat)
            seen = np.where(seen <= 0, seen * repeat, seen / repeat)
            z[ids] = seen - (counts.astype(np.float32) * np.float32(self.frequency) + np.float32(self.presence))
        return z


NO_PENALTIES = Penalties()


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults. temperature 0 means greedy; top_k 0, top_p 1 and
    min_p 0 switch those filters off. infill: llama.cpp's infill sampler after them
    (what llama.vscode asks for; see infill()). penalties: applied to each row first."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    infill: bool = False
    penalties: Penalties = NO_PENALTIES

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


SAMPLE_BLOCK = 4096  # Law.sample walks a large support in blocks of this many tokens


@dataclass(frozen=True)
class Law:
    """A sampling distribution kept on its support: the token ids it can draw (ascending)
    and their probabilities (summing to 1). With llama.cpp's default filters that is a few
    dozen tokens, so verification never walks the whole vocabulary; a draw from it is the
    dense distribution's (the same inverse CDF, in token order)."""

    ids: np.ndarray  # int64, ascending, distinct
    probs: np.ndarray  # float64, > 0

    @classmethod
    def point(cls, token: int) -> Law:
        return cls(np.array([token]), np.ones(1))

    def at(self, tokens: np.ndarray) -> np.ndarray:
        """The probabilities of `tokens` (0 off the support)."""
        where = np.minimum(np.searchsorted(self.ids, tokens), len(self.ids) - 1)
        return np.where(self.ids[where] == tokens, self.probs[where], 0.0)

    def prob(self, token: int) -> float:
        where = int(np.searchsorted(self.ids, token))
        return float(self.probs[where]) if where < len(self.ids) and self.ids[where] == token else 0.0

    def sample(self, u: float) -> int:
        """The token that the uniform draw u in [0, 1) picks (inverse CDF in token order).
        A support of many blocks is walked by its blocks' sums first (numpy's cumsum is
        slow: 0.5 ms over 151k tokens), then within the one block the draw falls in."""
        probs, start = self.probs, 0
        target = u * probs.sum()
        if len(probs) > SAMPLE_BLOCK:
            blocks = np.cumsum(np.add.reduceat(probs, np.arange(0, len(probs), SAMPLE_BLOCK)))
            b = min(int(np.searchsorted(blocks, target, side="right")), len(blocks) - 1)
            start, target = b * SAMPLE_BLOCK, target - (blocks[b - 1] if b else 0.0)
            probs = probs[start : start + SAMPLE_BLOCK]
        cum = np.cumsum(probs)
        return int(self.ids[start + min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)])

    def dense(self, n: int) -> np.ndarray:
        p = np.zeros(n)
        p[self.ids] = self.probs
        return p


def law(logits: np.ndarray, params: SamplingParams, vocab: Vocabulary | None = None) -> Law:
    """Final sampling distribution, on its support.

    Filters run in llama.cpp's default chain order: top-k, top-p, min-p on the
    untempered logits, then temperature on the survivors, then (params.infill, which
    needs the model's `vocab`) the infill sampler. The vocabulary is never sorted
    (see candidates())."""
    logits = np.asarray(logits)
    if params.greedy:
        return Law.point(int(np.argmax(logits)))
    ids, z = candidates(logits, params)
    if params.min_p > 0:
        keep = np.exp(z - z.max()) >= params.min_p  # probability relative to the top token's
        ids, z = ids[keep], z[keep]
    w = np.exp((z - z.max()) / params.temperature)
    if params.infill:
        ids, w = infill(ids, w, vocab)
    if not w.all():  # (a masked token's weight)
        ids, w = ids[w > 0], w[w > 0]
    if np.any(ids[1:] < ids[:-1]):
        order = np.argsort(ids)
        ids, w = ids[order], w[order]
    return Law(ids, w / w.sum())


def distribution(logits: np.ndarray, params: SamplingParams, vocab: Vocabulary | None = None) -> np.ndarray:
    """law() over the whole vocabulary (float64, sums to 1)."""
    return law(logits, params, vocab).dense(len(logits))


FIRST_GAP = 8.0  # without top-k, survivors are first looked for this many logits below the top one, then twice as far
BLOCK = 256  # top-k's threshold comes from the maxima of blocks of this many tokens


def candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """What top-k and top-p leave of the vocabulary, as (ids, logits in float64); min-p and
    temperature are law()'s. The vocabulary is never sorted, and read in two vectorised passes.

    Top-k: the k-th largest of the blocks' maxima is a threshold that at least k tokens reach
    (the k blocks' own maxima), so top-k's set is among the tokens that reach it: a few dozen
    more than k, where a threshold by a fixed gap from the top may take a few or thousands.
    Without top-k: the tokens within a gap of the top one, the gap doubling until a prefix by
    descending logit reaches top-p's mass (normalised over the whole vocabulary: one more pass).
    Only top-p sorts, and only these. Below min-p's floor nothing survives, so neither search
    goes lower, unless top-p must normalise over all of top-k's set."""
    n = len(logits)
    maxima = np.maximum.reduceat(logits, np.arange(0, n, BLOCK))
    top = float(maxima.max())
    k = params.top_k if 0 < params.top_k < n else n
    top_p = params.top_p < 1
    floor = top + math.log(params.min_p) if params.min_p > 0 else -math.inf
    if k < n:
        reached = float(np.partition(maxima, len(maxima) - k)[len(maxima) - k]) if len(maxima) >= k else -math.inf
        ids = np.flatnonzero(logits >= (reached if top_p else max(reached, floor)))
        if len(ids) > k:
            ids = ids[np.argpartition(-logits[ids], k - 1)[:k]]
        z = logits[ids].astype(np.float64)
        if not top_p:
            return ids, z
        ids, z, _ = _top_p_prefix(ids, z, top, params.top_p, float(np.exp(z - top).sum()))
        return ids, z
    if not top_p:
        ids = np.flatnonzero(logits >= floor)
        return ids, logits.astype(np.float64) if len(ids) == n else logits[ids].astype(np.float64)
    total = float(np.exp(logits - top, dtype=np.float64).sum())  # top-p's normaliser: the whole vocabulary
    lowest = float(np.min(logits, where=np.isfinite(logits), initial=top))
    gap = FIRST_GAP
    while True:
        threshold = max(top - gap, floor)
        ids = np.flatnonzero(logits >= threshold)
        ids, z, reached = _top_p_prefix(ids, logits[ids].astype(np.float64), top, params.top_p, total)
        if reached or threshold <= max(floor, lowest):
            return ids, z
        gap *= 2


def _top_p_prefix(
    ids: np.ndarray, z: np.ndarray, top: float, top_p: float, total: float
) -> tuple[np.ndarray, np.ndarray, bool]:
    """The candidates by descending logit, cut after the smallest prefix whose weights
    exp(z - top) reach top_p of `total`; all of them, and False, where they do not."""
    order = np.argsort(-z, kind="stable")
    ids, z = ids[order], z[order]
    mass = np.cumsum(np.exp(z - top)) / total
    if mass[-1] < top_p:
        return ids, z, False
    keep = int(np.searchsorted(mass, top_p)) + 1
    return ids[:keep], z[:keep], True


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


class Constraint(Protocol):
    """What an answer is held to (grammar.Grammar; healing.Healing): which tokens may come next,
    the law there, and its state, walked along the answer (accept) or ahead of it (a clone)."""

    @property
    def done(self) -> bool:
        """Nothing is constrained from here on."""

    def allows(self, ids: np.ndarray) -> np.ndarray: ...

    def law(self, logits: np.ndarray, params: SamplingParams, vocab: Vocabulary | None = None) -> Law:
        """The constrained law at this state (the target's, or a drafter's q)."""

    def argmax(self, logits: np.ndarray) -> int:
        """The constrained law's likeliest token (greedy)."""

    def accept(self, token: int) -> None: ...

    def clone(self) -> Constraint: ...

    def allowed_prefix(self, tokens: list[int]) -> list[int]: ...

    def forced_text(self, max_chars: int) -> str:
        """The only text that may come next, as far as it goes (a free draft; "" for none)."""

    def finished(self) -> bool:
        """Only an end of generation may come next."""


FIRST_LOOK = 256  # a grammar is asked about this many of the likeliest tokens first


def constrained_law(logits: np.ndarray, params: SamplingParams, allows: Allows, vocab: Vocabulary | None = None) -> Law:
    """The law under a grammar: p_g ∝ p·1[allowed], p the final distribution (so top-k,
    top-p, min-p and temperature act as without a grammar, then what the grammar forbids
    is removed). Where the grammar forbids all of p's support, p_g is the distribution of
    the allowed tokens' logits alone. Only p's support is checked against the grammar,
    which is cheap (a full vocabulary takes llama.cpp 10-200 ms), unless that fallback is needed."""
    p = law(logits, params, vocab)
    kept = allows(p.ids)
    if kept.any():
        return Law(p.ids[kept], p.probs[kept] / p.probs[kept].sum())
    ids = allowed_top(logits, allows, 1 if params.greedy else params.top_k)
    masked = np.full(len(logits), -np.inf)
    masked[ids] = logits[ids]
    return law(masked, params, vocab)


def constrained(
    logits: np.ndarray, params: SamplingParams, allows: Allows, vocab: Vocabulary | None = None
) -> np.ndarray:
    """constrained_law() over the whole vocabulary."""
    return constrained_law(logits, params, allows, vocab).dense(len(logits))


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


def position_uniforms(seed: int, start: int, count: int, columns: int = 2) -> np.ndarray:
    """(count, columns) uniform draws for the sequence positions start, start+1, ...: column 0
    decides a draft token's acceptance, column 1 draws a token, columns 2.. decide a tree's
    later siblings (see verify_tree). They depend only on the seed and the position, so a
    seeded answer is the same however it was drafted: a counter-based generator, SplitMix64's
    finaliser of (seed, position, column), 53 bits each (a numpy Generator per position cost
    10 µs, a tenth of a GPU round's budget)."""
    key = _splitmix(seed & MASK64)
    return np.array(
        [
            [(_splitmix(_splitmix(key ^ position) ^ column) >> 11) * 2.0**-53 for column in range(columns)]
            for position in range(start, start + count)
        ]
    )


MASK64 = 2**64 - 1


def _splitmix(x: int) -> int:
    """SplitMix64's step and finaliser, on 64-bit unsigned integers."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def acceptance_probability(p: Law, q: Law | None, x: int) -> float:
    """min(1, p(x)/q(x)); a deterministic draft (q None) is the point mass δx."""
    q_x = 1.0 if q is None else q.prob(x)
    return min(1.0, p.prob(x) / q_x) if q_x > 0 else 0.0


def residual(p: Law, q: Law | None, x: int) -> Law:
    """norm(max(p - q, 0)), on the union of the two supports: where the next token comes
    from after x is rejected."""
    if q is None:
        ids, r = p.ids, np.where(p.ids == x, 0.0, p.probs)  # max(p - δx, 0): x removed
    else:
        ids = np.union1d(p.ids, q.ids)
        r = np.maximum(p.at(ids) - q.at(ids), 0.0)
    kept = r > 0
    total = r[kept].sum()
    # total == 0 only if p == q up to rounding, where rejection has probability ~0: any draw from p is exact
    return Law(ids[kept], r[kept] / total) if total > 0 else p


def verify(
    draft: Sequence[int],
    q_rows: Sequence[Law] | None,
    p_row: Callable[[int], Law],
    uniforms: np.ndarray,
) -> tuple[int, int]:
    """Accept a chain of drafts left to right; return (number accepted, next token).

    draft: γ proposed token ids. q_rows: the γ draft laws they were drawn from, or
    None for a deterministic draft (point masses). p_row(i): the target's law at row
    i, conditioned on the context plus draft[:i]; asked for i = 0, 1, ... in order,
    only as far as verification goes. uniforms: (γ+1, 2) draws for those positions
    (see position_uniforms).

    Token x_i is accepted with probability min(1, p_i(x)/q_i(x)). At the first
    rejection the next token comes from norm(max(p_i - q_i, 0)) and the rest of
    the draft is dropped; if all γ pass, a bonus token is sampled from p_γ. The
    result is distributed exactly as the target alone (Leviathan et al., Thm 1).
    A point mass x is accepted exactly when the position's own draw from p_i is x
    (probability p_i(x), as the rule above, and otherwise that draw is the next
    token, from p_i without x): so copies never change a seeded answer. A chain is
    the tree whose every node has one child (verify_tree).
    """
    path, token = verify_tree(draft, None, q_rows, p_row, uniforms)
    return len(path), token


def verify_tree(
    tokens: Sequence[int],
    parents: Sequence[int] | None,
    q_rows: Sequence[Law | None] | None,
    p_row: Callable[[int], Law],
    uniforms: np.ndarray,
) -> tuple[list[int], int]:
    """Accept a tree of drafts from its root down; return (the accepted nodes, root first; next token).

    tokens[i]: node i's token; parents[i]: its parent node (-1: the context's last token;
    None: a chain, parents[i] = i - 1), parents before children. q_rows[i]: the law node i
    was drawn from, given its earlier siblings (None, or q_rows None: a point mass).
    p_row(r): the target's law at row r: row 0 follows the context, row i + 1 follows node
    i. uniforms: a row per depth, 1 + (most children of a node) columns.

    Recursive rejection sampling (SpecInfer's multi-step speculative sampling; Jeon et al.
    2024, arXiv 2402.14160; Sequoia's accept step), at each node reached, over its children
    in the order drafted: sibling x_j, drawn from q_j, is accepted with probability
    min(1, p_j(x_j)/q_j(x_j)); on rejection p_{j+1} = norm(max(p_j - q_j, 0)). Why exact:
    one step of the chain's rule gives a token distributed as p_j whether x_j is accepted
    (density min(p_j, q_j)) or the residual drawn (density max(p_j - q_j, 0)); so a
    rejection leaves the token still to come distributed as p_{j+1}, and the next sibling
    (drawn from q_{j+1}, however it depends on the earlier siblings: without replacement,
    q_{j+1} = q_j without x_j, renormalised) faces the same problem one step down. A
    rejected x_j has p_j(x_j) <= q_j(x_j), so p_{j+1}(x_j) = 0: no sibling comes twice.
    Deterministic children (point masses: a copy's alternatives) come last, all at once:
    the draw from the last residual is the next token, and the round descends to the
    child that equals it (so copies never change a seeded answer). Every node's token is
    thus drawn from the target's law at its row, as the target alone would.
    """
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(range(-1, len(tokens) - 1) if parents is None else parents):
        children.setdefault(parent, []).append(node)
    path: list[int] = []
    node = -1
    while True:
        u, p = uniforms[len(path)], p_row(node + 1)
        chosen = None
        for j, child in enumerate(children.get(node, ())):
            q = q_rows[child] if q_rows is not None else None
            if q is None:
                continue  # a point mass: by the draw below
            if u[0 if j == 0 else j + 1] < acceptance_probability(p, q, tokens[child]):
                chosen = child
                break
            p = residual(p, q, tokens[child])
        if chosen is None:
            token = p.sample(u[1])
            points = (c for c in children.get(node, ()) if q_rows is None or q_rows[c] is None)
            if (chosen := next((c for c in points if tokens[c] == token), None)) is None:
                return path, token
        path.append(chosen)
        node = chosen


def verify_greedy(draft: Sequence[int], target_argmax: Callable[[int], int]) -> tuple[int, int]:
    """Greedy verification: accept while the draft equals the target's argmax.
    target_argmax(i) is the target's choice at row i (asked in order, as far as
    verification goes); the token after the accepted prefix is the target's own
    choice there (the correction, or the bonus token)."""
    path, token = verify_tree_greedy(draft, None, target_argmax)
    return len(path), token


def verify_tree_greedy(
    tokens: Sequence[int], parents: Sequence[int] | None, target_argmax: Callable[[int], int]
) -> tuple[list[int], int]:
    """Greedy verification of a tree (as verify_tree's arguments): from the root, descend to the
    child equal to the target's argmax at the node's row, while there is one; the next token
    is the target's argmax at the last node reached."""
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for node, parent in enumerate(range(-1, len(tokens) - 1) if parents is None else parents):
        children.setdefault((parent, tokens[node]), node)
    path: list[int] = []
    node = -1
    while (child := children.get((node, choice := target_argmax(node + 1)))) is not None:
        path.append(child)
        node = child
    return path, choice
