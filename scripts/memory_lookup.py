"""Times the memory's suffix index at a size: a lookup per round (the longest end of a context,
and what followed it) and an answer's insertion, over N remembered tokens of sequences that
repeat each other's text (as prompts and answers do). Prints the figures and the bytes a
million tokens take.

    python scripts/memory_lookup.py --tokens 10000000
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from edgespec.suffixes import DEPTH, SEPARATOR, TOKEN, SuffixIndex


def corpus(n: int, rng: np.random.Generator) -> np.ndarray:
    """Sequences of ~2,000 tokens (Zipf-distributed ids), a fifth of each copied from earlier text."""
    tokens = (rng.zipf(1.2, n) % 150_000).astype(np.int64)
    for _ in range(n // 2_000):
        length = int(rng.integers(50, 800))
        src, dst = rng.integers(0, n - length, size=2)
        tokens[dst : dst + length] = tokens[src : src + length]
    tokens[rng.integers(0, n, size=n // 2_000)] = SEPARATOR
    tokens[-1] = SEPARATOR
    return tokens


def suffix_order(tokens: np.ndarray, depth: int = DEPTH) -> np.ndarray:
    """The suffixes' order by their first `depth` tokens (prefix doubling, one int64 key a round)."""
    n = len(tokens)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)
    h = 1
    while h < depth:
        nxt = np.zeros(n, np.int64)
        nxt[:-h] = rank[h:] + 1
        key = rank * (n + 1) + nxt
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        new = np.empty(n, np.int64)
        new[order] = np.concatenate([[0], np.cumsum(sorted_key[1:] != sorted_key[:-1])])
        rank, h = new, h * 2
    order = np.argsort(rank, kind="stable")
    return order[tokens[order] != SEPARATOR].astype(np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--lookups", type=int, default=2_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = corpus(args.tokens, rng)
    start = time.perf_counter()
    index = SuffixIndex(tokens.astype(TOKEN), suffix_order(tokens))
    print(f"{args.tokens:,} tokens indexed in {time.perf_counter() - start:.1f} s (the script's bulk sort)")
    print(f"memory: {(len(index._bytes) + index.order.nbytes) / len(index) * 1e6 / 2**20:.1f} MiB a million tokens")
    contexts = []
    for _ in range(args.lookups):  # a context ending in remembered text half the time, in new text else
        at = int(rng.integers(DEPTH, args.tokens))
        context = tokens[at - 200 : at].tolist() if at > 200 else tokens[:at].tolist()
        context = [t for t in context if t != SEPARATOR] or [1]
        if rng.random() < 0.5:
            context += rng.integers(0, 150_000, size=3).tolist()
        contexts.append(context)
    times, found = [], 0
    for context in contexts:
        t0 = time.perf_counter()
        match = index.longest(context, 4, 64)
        if match is not None:
            index.following(match.positions, 64)
            found += 1
        times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    print(
        f"lookup + continuations: p50 {np.median(ms):.3f} ms, p90 {np.percentile(ms, 90):.3f} ms,"
        f" max {ms.max():.3f} ms ({found} of {len(contexts)} found)"
    )
    answer = rng.integers(0, 150_000, size=1_000).tolist()
    t0 = time.perf_counter()
    index.add(answer)
    print(f"a 1,000-token answer inserted in {(time.perf_counter() - t0) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
