"""Drafts from the memory (memory.py): what followed the context's end wherever earlier prompts
and answers hold it (SuffixDecoding, Oliaro et al. 2025), free; and where the target parted
from such a text for a few tokens (another name in an answer of the same shape), that text again
from where the target's next tokens are found in it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..memory import Memory
from ..modes import Source
from .base import Draft, Drafter
from .copy import Alternative, CopyOutcome

SHORTEST_MATCH = 4  # a context's end shorter than this, found in millions of tokens, says little
PLACES = 64  # of a match's places, the continuations read (an even sample of more)
DEPTH_PER_MATCH = 2  # a draft runs at most this many tokens per token of its match (vLLM's suffix: 1)
MIN_PATH_SHARE = 0.1  # a chain stops where fewer of its places go on as it does (SuffixDecoding's min_token_prob)
# where a recall's places parted from the target: their next tokens are searched for the
# context's last k tokens (k, within how many: NEAR_KEYS, longest first; one token alone only
# very near), while the context's own match is shorter than FOUND_AGAIN_BELOW and the target
# has written at most NEAR tokens since
NEAR = 32
NEAR_KEYS = ((3, NEAR), (2, NEAR), (1, 8))
FOUND_AGAIN_BELOW = 8


@dataclass(frozen=True)
class Recall:
    """What the memory says follows the context: the chain of the likeliest continuation, how
    long the context's end it was found after is (its evidence), and every continuation with its
    share of the places (a tree's branches)."""

    draft: Draft
    evidence: int
    alternatives: list[Alternative]


@dataclass(frozen=True)
class Expected:
    """A recall's chain, to be compared with what the target then wrote, and the places (in the
    memory) whose text it is."""

    tokens: list[int]
    at: int  # the context's length when it was made
    evidence: int
    places: np.ndarray
    matched: int  # the length of the context's end that the text was first found after


@dataclass(frozen=True)
class Parted:
    """Where the places of a recall parted from what the target wrote (the positions of their
    first token not written), the context's length then, and the length of the context's end
    that their text was first found after (each time it is found again, it counts half that)."""

    places: np.ndarray
    at: int
    matched: int


class MemoryDrafter(Drafter):
    """One per request: reads the engine's memory, never the request's own text (the copy
    drafter owns the context): the recent sequences the prompt continues, its conversation's
    earlier turns, are left out. Like a copy, its acceptance is learnt from every token the
    target writes after a recall (outcomes()), drafted or not. Where the target parts from a
    recalled text (it writes another value into an answer of the same shape), the text is found
    again a few tokens on, as a copy's alignment is (see NEAR)."""

    def __init__(self, memory: Memory, max_tokens: int = 64) -> None:
        self.memory, self.max_tokens = memory, max_tokens
        self.excluded = []
        self._expected: Expected | None = None
        self._parted: Parted | None = None
        self._outcomes: list[CopyOutcome] = []

    def begin(self, prompt: list[int]) -> None:
        self.excluded = self.memory.continued_by(prompt)
        self._expected, self._parted, self._outcomes = None, None, []

    def recall(self, context: list[int], n: int) -> Recall | None:
        """The likeliest continuation of `context`'s end (up to n tokens, and as deep as its match
        and the places that agree support), with the others; None where nothing is remembered."""
        match = self.memory.longest(context, SHORTEST_MATCH, PLACES, self.excluded)
        near = None
        if match is None or match.length < FOUND_AGAIN_BELOW:
            near = self._found_again(context)
        if near is None and match is None:
            self._expected = None
            return None
        if near is not None:
            positions, evidence, matched = near
        else:
            positions, evidence, matched = match.positions, match.length, match.length
        n = min(n, self.max_tokens, DEPTH_PER_MATCH * evidence)
        texts = self.memory.index.following(positions, n)
        found = Counter(texts)
        chain = _likeliest_path(found)
        taken = np.array([text[: len(chain)] == tuple(chain) for text in texts], dtype=bool)
        self._expected = Expected(chain, len(context), evidence, positions[taken], matched)
        places = sum(found.values())
        ranked = [Alternative(list(text), count / places) for text, count in found.most_common() if text]
        return Recall(Draft(chain, None, source=Source.MEMORY), evidence, ranked)

    def _found_again(self, context: list[int]) -> tuple[np.ndarray, int, int] | None:
        """(positions, evidence, the first match's length) after the context's last few tokens, found
        in the text where the last recall's places parted from the target (nearest first); None
        where not found."""
        parted = self._parted
        if parted is None or len(context) - parted.at > NEAR:
            return None
        windows = self.memory.index.following(parted.places, NEAR + NEAR_KEYS[0][0])
        for k, reach in NEAR_KEYS:
            end, found = tuple(context[-k:]), []
            for place, text in zip(parted.places.tolist(), windows, strict=True):
                at = next((i for i in range(min(len(text) - k + 1, reach)) if text[i : i + k] == end), None)
                if at is not None:
                    found.append(place + at + k)
            if found:
                return np.array(found, dtype=np.int64), max(k, parted.matched // 2), parted.matched
        return None

    def draft(self, context, n, params=None, rng=None, stop_below=(), grammar=None) -> Draft:
        found = self.recall(context, n)
        return found.draft if found is not None else Draft([], None, source=Source.MEMORY)

    def accept(self, context: list[int]) -> None:
        """What the target wrote after the last recall, against its chain: agreed tokens, then
        the first disagreement (as a round's acceptance is counted)."""
        expected = self._expected
        if expected is None:
            return
        agreed = 0
        for token, drafted in zip(context[expected.at :], expected.tokens, strict=False):
            self._outcomes.append(CopyOutcome(Source.MEMORY, expected.evidence, token == drafted))
            if token != drafted:
                break
            agreed += 1
        if len(context) - expected.at <= agreed:  # it wrote what the recall said, all of it
            self._parted = None
        elif len(expected.places):  # it went its own way there: the places' text is looked for a few tokens on
            self._parted = Parted(expected.places + agreed, expected.at + agreed, expected.matched)
        self._expected = None

    def outcomes(self) -> list[CopyOutcome]:
        outcomes, self._outcomes = self._outcomes, []
        return outcomes


def _likeliest_path(found: Counter) -> list[int]:
    """The continuation taken token by token by the most places (a trie's heaviest children), while
    the places that still agree with it are MIN_PATH_SHARE of all."""
    total = sum(found.values())
    alive, chain = list(found.items()), []
    while True:
        votes: Counter = Counter()
        for text, count in alive:
            if len(text) > len(chain):
                votes[text[len(chain)]] += count
        if not votes:
            return chain
        token, count = votes.most_common(1)[0]
        if count < MIN_PATH_SHARE * total:
            return chain
        chain.append(token)
        alive = [(text, c) for text, c in alive if len(text) > len(chain) - 1 and text[len(chain) - 1] == token]
