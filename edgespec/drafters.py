"""Drafters: each proposes the next few tokens; the engine verifies them.

Like llama.cpp's common/speculative.cpp, making a draft is split from verifying
it: a drafter begins with the prompt, drafts before a round and accepts what the
round kept; the engine does not care where a draft came from, only that q (if
given) is the distribution each token was drawn from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .grammar import MAX_FORCED_CHARS, Grammar
from .model import Model
from .modes import Source
from .sampling import Law, SamplingParams, constrained_argmax, constrained_law, law

CONTEXT, PREDICTION = 0, 1  # the copy drafter's sources
SOURCE_NAMES = (Source.COPY, Source.PREDICTION)  # what a copy draft reports as its source, per source
NGRAM_SIZES = (16, 8, 5, 3)  # the n-grams a copy is anchored on, longest first
# re-anchoring after the target left the source: its last k tokens are looked for this far
# (in source tokens) from where the pointer was lost; one token alone only very near
LOCAL_REACH = ((3, 256), (2, 32), (1, 4))
LOCAL_BACK = 8  # the target may also repeat a little of what it already wrote
LOCAL_SPAN = 32  # past this many tokens since the loss, only a global n-gram match re-anchors
MAX_RULE = (4, 8)  # longest learnt substitution: source tokens -> what the target wrote instead
REANCHOR_KEEPS = 0.5  # of the evidence an alignment had, what it keeps when found again nearby
MIN_LOST = 4  # an alignment that held for fewer tokens was a chance match: not worth finding again
MIN_RENAME = 3  # shortest word whose renaming is carried over to the other tokens it appears in


@dataclass
class Draft:
    tokens: list[int]
    # the laws the tokens were sampled from (one per token); None means each token is
    # a point mass (deterministic drafts, and every greedy draft)
    q: list[Law] | None = None
    source: Source = Source.MODEL  # which kind of drafter made it: acceptance is tracked per source

    def __post_init__(self) -> None:
        self.source = Source(self.source)  # (a drafter of the user's may name it as a string)


class Drafter(Protocol):
    """begin(prompt), then per round draft(...) and accept(context)."""

    model: Model | None  # the model it runs (None: a free drafter, which costs nothing to run)

    def begin(self, prompt: list[int]) -> None:
        """Get ready to draft after the request's prompt (timed as prefill)."""

    def draft(
        self,
        context: list[int],
        n: int,
        params: SamplingParams,
        rng: np.random.Generator,
        stop_below: Sequence[float] = (),
        grammar: Grammar | None = None,
    ) -> Draft:
        """Propose up to n tokens to follow `context`. A drafter that knows its
        confidence stops before token i once the product of its confidences in
        tokens 0..i falls below stop_below[i] (a hint; others may ignore it).
        grammar: the answer's grammar in its state after `context` (not to be advanced:
        clone it to walk ahead); a drafter that samples masks its q with it, so that
        min(1, p_g/q_g) stays exact."""

    def accept(self, context: list[int]) -> None:
        """A round is over: `context` is the sequence now (the drafts the target kept, and its token)."""


class ModelDrafter:
    """Drafts with a small model sharing the target's tokenizer."""

    def __init__(self, model: Model, target_vocab: int) -> None:
        self.model = model
        self.target_vocab = target_vocab  # drafts stay within the ids the target has

    def begin(self, prompt: list[int]) -> None:
        kept = self.model.sync(prompt)
        self.model.eval(prompt[kept:-1])

    def accept(self, context: list[int]) -> None:
        """Drop the rejected drafts from the cache (the tokens the target added are read at the next draft)."""
        self.model.sync(context)

    def draft(self, context, n, params, rng, stop_below=(), grammar=None) -> Draft:
        model = self.model
        walk = grammar.clone() if grammar is not None else None  # the grammar along this draft
        logits = model.eval(context[len(model.tokens) :])  # the tokens written since its last draft
        model.checkpoint()  # a recurrent state: the next round's sync comes back here
        tokens: list[int] = []
        q_rows: list[Law] | None = None if params.greedy else []  # the laws the tokens were drawn from
        p_all = 1.0  # the draft's own estimate that every token so far is accepted
        shared = min(model.n_vocab, self.target_vocab)  # token ids both vocabularies have
        while True:
            if params.greedy:
                token = int(np.argmax(logits)) if walk is None else constrained_argmax(logits[:shared], walk.allows)
                # (without the grammar's mask: a hint is all it needs to be)
                confidence = 1.0 / np.exp(logits - logits[token]).sum() if stop_below else 1.0
            else:
                q = (
                    law(logits[:shared], params, model)
                    if walk is None
                    else constrained_law(logits[:shared], params, walk.allows, model)
                )
                q_rows.append(q)
                token = q.sample(rng.random())
                confidence = q.prob(token)
            p_all *= confidence
            if len(tokens) < len(stop_below) and p_all < stop_below[len(tokens)]:
                break  # not worth verifying: drop it (its draft step is already paid)
            tokens.append(token)
            if len(tokens) == n or model.is_eog(token):  # nothing useful follows an end of generation
                break
            if walk is not None:
                walk.accept(token)
            logits = model.eval([token])
        return Draft(tokens, None if q_rows is None else q_rows[: len(tokens)], source=Source.MODEL)


@dataclass(frozen=True)
class Pointer:
    """Where a copy is in its source: at the next raw source token."""

    source: int  # CONTEXT or PREDICTION
    pos: int


@dataclass(frozen=True)
class Gap:
    """Where the pointer was lost, to look for the target's next tokens near it."""

    source: int
    pos: int  # the source position the target left
    context_len: int  # the context's length then


@dataclass(frozen=True)
class Rule:
    """A learnt substitution: where the source says `span`, the target writes `replacement`."""

    span: tuple[int, ...]
    replacement: tuple[int, ...]


@dataclass(frozen=True)
class RuleInUse:
    """A substitution the pointer is following, from raw source position `start`."""

    start: int
    rule: Rule


@dataclass(frozen=True)
class CopyOutcome:
    """One token the target wrote while a copy was aligned: was it what the copy expected?"""

    source: Source  # COPY or PREDICTION
    evidence: int  # tokens the alignment had held for
    matched: bool


class Substitutions:
    """The learnt substitutions by the first token of their span, the longest span first."""

    def __init__(self) -> None:
        self.table: dict[int, list[Rule]] = {}

    def match(self, tokens: list[int], i: int) -> Rule | None:
        """The rule whose span `tokens` has at position i, if any."""
        for rule in self.table.get(tokens[i], ()):
            if tuple(tokens[i : i + len(rule.span)]) == rule.span:
                return rule
        return None

    def add(self, rule: Rule) -> None:
        self.forget(rule.span)
        rules = self.table.setdefault(rule.span[0], [])
        rules.append(rule)
        rules.sort(key=lambda r: -len(r.span))  # the longest span wins

    def forget(self, span: tuple[int, ...]) -> None:
        self.table[span[0]] = [r for r in self.table.get(span[0], []) if r.span != span]

    def clear(self) -> None:
        self.table.clear()


class NgramIndex:
    """Where each n-gram of a token list occurs (n in `sizes`), as the positions of the
    token that follows it; filled incrementally as the list grows."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = sorted(sizes, reverse=True)
        self.tables: dict[int, dict[tuple, list[int]]] = {n: {} for n in self.sizes}
        self.indexed = 0  # followers at positions < this are indexed

    def extend(self, tokens: list[int]) -> None:
        """Index n-grams of `tokens` whose follower is known, i.e. not those ending at its last token."""
        for follower in range(max(self.indexed, 1), len(tokens)):
            for n in self.sizes:
                if follower >= n:
                    self.tables[n].setdefault(tuple(tokens[follower - n : follower]), []).append(follower)
        self.indexed = max(self.indexed, len(tokens))

    def clear(self) -> None:
        for table in self.tables.values():
            table.clear()
        self.indexed = 0


class Conversation:
    """The conversation's tokens (prompt and answers) and their n-grams, kept from request to
    request for the copy drafters of each: a long prompt is indexed once (20k tokens: 0.2 s)."""

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES) -> None:
        self.tokens: list[int] = []
        self.ngrams = NgramIndex(sizes)

    def continued_by(self, context: list[int]) -> bool:
        return len(context) >= len(self.tokens) and context[: len(self.tokens)] == self.tokens

    def clear(self) -> None:
        self.tokens.clear()
        self.ngrams.clear()


class CopyDrafter:
    """Copies ahead from a source text, aligned to it the way a diff aligns two files.

    One per request. Sources: the context (prompt and output so far) and a predicted output
    (OpenAI's Predicted Outputs: text the answer will largely repeat). A pointer into a
    source follows the target token by token; while they agree, drafts are what comes
    next there (long, up to `max_tokens`). When the target writes something else, the
    pointer is lost, and it re-anchors on the target's own next tokens near where it was,
    so a skipped, inserted or replaced word costs a round or two instead of a fresh long
    n-gram; failing that, on the longest n-gram match anywhere. What the target wrote in
    place of a source span becomes a substitution applied to later drafts (the source
    says `items`, the target wrote `records`: later drafts say `records`), dropped if the
    target disagrees. Drafts are deterministic: point masses. The pointer moves only in
    begin() and accept(); draft() reads it.

    `evidence` (tokens agreed since the pointer was set) tells the controller how far to trust a draft."""

    model = None  # free: it runs no model

    def __init__(
        self,
        vocab: Model | None = None,
        *,
        prediction: Sequence[int] = (),
        conversation: Conversation | None = None,
        max_tokens: int = 64,
        sizes: Sequence[int] = NGRAM_SIZES,
    ) -> None:
        """vocab: the target (its piece() and tokenize()), to carry renames over to other tokens;
        conversation: the engine's, shared by its requests (default: one of this drafter's own)."""
        self.vocab = vocab
        self.max_tokens = max_tokens
        self.conversation = conversation or Conversation(sizes)
        self.sources: tuple[list[int], list[int]] = (self.conversation.tokens, list(prediction))
        self.indexes = (self.conversation.ngrams, NgramIndex(self.conversation.ngrams.sizes))
        self.indexes[PREDICTION].extend(self.sources[PREDICTION])
        self.rules = Substitutions()
        self._outcomes: list[CopyOutcome] = []
        self._reset_alignment()

    def _reset_alignment(self) -> None:
        self.ptr: Pointer | None = None
        self.pending: list[int] = []  # a substitution's tokens still expected before the pointer's token
        self.rule_at: RuleInUse | None = None  # the substitution being followed
        self.gap: Gap | None = None  # where the pointer was lost
        self.lost_evidence = 0  # how long the alignment had held when it was lost
        self.evidence = 0
        self.prediction_pos = 0  # how far into the prediction the target has followed

    # --- the Drafter protocol ---------------------------------------------------
    def begin(self, prompt: list[int]) -> None:
        """The request's prompt: the answer starts at the beginning of the prediction, if any."""
        self._follow(prompt)
        self._reset_alignment()
        self._outcomes.clear()
        if self.sources[PREDICTION]:  # the client says the answer will largely repeat it
            self.ptr = Pointer(PREDICTION, 0)
        else:
            self._anchor()

    def accept(self, context: list[int]) -> None:
        """Take in the tokens the context gained, moving the pointer along (and anchoring it
        again where it was lost)."""
        self._follow(context)
        if self.ptr is None:
            self._anchor()

    def outcomes(self) -> list[CopyOutcome]:
        """What the copy expected of each token the context gained since the last call, against
        what the target wrote: the copy's acceptance rate, measured free."""
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def draft(self, context, n, params=None, rng=None, stop_below=(), grammar=None) -> Draft:
        """What the source says comes next (`context` as last followed)."""
        if self.ptr is None:
            return Draft([], None, source=SOURCE_NAMES[CONTEXT])
        return Draft(self._expected(min(n, self.max_tokens)), None, source=SOURCE_NAMES[self.ptr.source])

    # --- following the target ---------------------------------------------------
    def _follow(self, context: list[int]) -> None:
        seen = self.sources[CONTEXT]
        if not self.conversation.continued_by(context):  # a different conversation
            self.conversation.clear()
            self._reset_alignment()
        for token in context[len(seen) :]:
            seen.append(token)
            if self.ptr is not None:
                self._step(token)
        self.indexes[CONTEXT].extend(seen)

    def _step(self, token: int) -> None:
        expected = self._peek()
        self._outcomes.append(CopyOutcome(SOURCE_NAMES[self.ptr.source], self.evidence, expected == token))
        if expected == token:
            if self.pending:
                self.pending.pop(0)
            else:
                self.ptr = Pointer(self.ptr.source, self.ptr.pos + 1)
            self.evidence += 1
            if self.ptr.source == PREDICTION:
                self.prediction_pos = max(self.prediction_pos, self.ptr.pos)
            return
        source = self.ptr.source
        if self.pending and len(self.pending) == len(self.rule_at.rule.replacement):  # a substitution, not begun
            start = self.rule_at.start
            if self.sources[source][start] == token:  # the substitution was wrong here: forget it, copy as is
                self.rules.forget(self.rule_at.rule.span)
                self.ptr, self.pending = Pointer(source, start + 1), []
                self.evidence += 1
                return
        lost_at = self.rule_at.start if self.pending else self.ptr.pos
        self.gap = Gap(source, lost_at, len(self.sources[CONTEXT]) - 1)
        # the client said the answer repeats the prediction: once lost there, always look nearby
        self.lost_evidence = max(self.evidence, MIN_LOST if source == PREDICTION else 0)
        self.ptr, self.pending, self.rule_at, self.evidence = None, [], None, 0

    def _peek(self) -> int | None:
        """The next token the source (with substitutions) expects; starts a substitution if one applies."""
        if self.pending:
            return self.pending[0]
        source, i = self.ptr.source, self.ptr.pos
        tokens = self.sources[source]
        while i < len(tokens) and (rule := self.rules.match(tokens, i)):
            self.rule_at, i = RuleInUse(i, rule), i + len(rule.span)
            self.ptr = Pointer(source, i)
            if rule.replacement:
                self.pending = list(rule.replacement)
                return self.pending[0]
        return tokens[i] if i < len(tokens) else None

    def _expected(self, n: int) -> list[int]:
        """Up to n tokens the source expects next, substitutions applied."""
        out = self.pending[:n]
        tokens, i = self.sources[self.ptr.source], self.ptr.pos
        while len(out) < n and i < len(tokens):
            if rule := self.rules.match(tokens, i):
                out.extend(rule.replacement)
                i += len(rule.span)
            else:
                out.append(tokens[i])
                i += 1
        return out[:n]

    # --- substitutions ----------------------------------------------------------
    def _learn(self, span: list[int], replacement: list[int]) -> None:
        if not (0 < len(span) <= MAX_RULE[0] and len(replacement) <= MAX_RULE[1] and span != replacement):
            return
        self.rules.add(Rule(tuple(span), tuple(replacement)))
        if self.vocab is not None:
            self._generalise(span, replacement)

    def _generalise(self, span: list[int], replacement: list[int]) -> None:
        """A renamed word is renamed in every token it appears in: ` items` -> ` records` also
        gives `_items` -> `_records`, ` item` -> ` record` and `Item` -> `Record` for the
        tokens of the sources (what is left of the two texts without their common ends)."""
        old, new = (b"".join(map(self.vocab.piece, t)).decode("utf-8", "replace") for t in (span, replacement))
        prefix = len(os.path.commonprefix([old, new]))
        old, new = old[prefix:], new[prefix:]
        suffix = len(os.path.commonprefix([old[::-1], new[::-1]]))
        old, new = old[: len(old) - suffix], new[: len(new) - suffix]
        if len(old) < MIN_RENAME or not old.isidentifier() or not new.isidentifier():
            return
        variants = {old: new, old.lower(): new.lower(), old.capitalize(): new.capitalize(), old.upper(): new.upper()}
        for token in set(self.sources[CONTEXT]) | set(self.sources[PREDICTION]):
            text = self.vocab.piece(token).decode("utf-8", "replace")
            renamed = text
            for a, b in variants.items():
                renamed = renamed.replace(a, b)
            if renamed != text and (token,) != tuple(span):
                self.rules.add(Rule((token,), tuple(self.vocab.tokenize(renamed, add_special=False))))

    # --- anchoring ----------------------------------------------------------------
    def _anchor(self) -> None:
        """Point into a source again: near where the pointer was lost, else anywhere."""
        context = self.sources[CONTEXT]
        gap = self.gap
        if gap and self.lost_evidence >= MIN_LOST and len(context) - gap.context_len <= LOCAL_SPAN:
            if self._anchor_near(gap) or gap.source == PREDICTION:
                return  # lost in the prediction, the answer is expected back there soon: wait for it
        self._anchor_anywhere()

    def _anchor_near(self, gap: Gap) -> bool:
        source, lost_at, lost_len = gap.source, gap.pos, gap.context_len
        context, tokens = self.sources[CONTEXT], self.sources[source]
        for k, reach in LOCAL_REACH:
            if k > len(context):
                continue
            suffix = context[-k:]
            # positions q just past a copy of the suffix, nearest to the loss first (forward on ties)
            # (in the context itself, only before the loss: after it is the target's own new text)
            end = lost_len if source == CONTEXT else len(tokens) - 1
            lo, hi = max(k, lost_at - LOCAL_BACK + k), min(end, lost_at + reach + k)
            for q in sorted(range(lo, hi + 1), key=lambda q: (abs(q - k - lost_at), q < lost_at + k)):
                if tokens[q - k : q] == suffix:
                    # what the target wrote between the loss and this anchor replaced that source span
                    self._learn(tokens[lost_at : q - k], context[lost_len : len(context) - k])
                    # a long alignment found again just past a small edit still counts (all of
                    # it in a prediction: the client said the answer repeats it)
                    keeps = 1.0 if source == PREDICTION else REANCHOR_KEEPS
                    self.ptr, self.evidence = Pointer(source, q), max(k, int(self.lost_evidence * keeps))
                    return True
        return False

    def _anchor_anywhere(self) -> None:
        """The longest n-gram ending the context that occurs in a source: the prediction's
        next occurrence past where it was followed to, else the context's latest."""
        context = self.sources[CONTEXT]
        for n in self.indexes[CONTEXT].sizes:
            if n >= len(context):
                continue
            key = tuple(context[-n:])
            if found := self.indexes[PREDICTION].tables[n].get(key):
                q = next((q for q in found if q >= self.prediction_pos), found[-1])
                self.ptr, self.evidence = Pointer(PREDICTION, q), n
                return
            if found := self.indexes[CONTEXT].tables[n].get(key):
                self.ptr, self.evidence = Pointer(CONTEXT, found[-1]), n
                return


class GrammarDrafter:
    """Drafts what the grammar forces: where it allows one continuation only (a schema's
    keys, JSON punctuation, closing brackets), that text's tokens, as a point mass. Free
    (no model runs); the target still verifies them, since it may split the text into
    other tokens than the tokenizer does alone."""

    model = None  # free: it runs no model

    def __init__(self, vocab: Model, max_chars: int = MAX_FORCED_CHARS) -> None:
        self.vocab = vocab
        self.max_chars = max_chars

    def begin(self, prompt: list[int]) -> None:
        pass

    def accept(self, context: list[int]) -> None:
        pass  # the grammar's state is the run's: it moves with the answer

    def draft(self, context, n, params=None, rng=None, stop_below=(), grammar=None) -> Draft:
        if grammar is None or not (text := grammar.forced_text(self.max_chars)):
            return Draft([], None, source=Source.GRAMMAR)
        tokens = self.vocab.tokenize(text, add_special=False)
        return Draft(grammar.allowed_prefix(tokens)[:n], None, source=Source.GRAMMAR)
