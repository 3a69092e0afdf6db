"""Copy drafting: tokens copied ahead from source texts (the context, a predicted output), free."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..model import TREE_BRANCHES, Model
from ..modes import Source
from ..prompt_cache import common_prefix
from .base import Branching, Draft, Drafter, leaves

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
ALTERNATIVE_PLACES = 32  # a tree's copies look at the latest this many places an n-gram occurs (a round's cost)
PREDICTION_CREDIT = 16  # the evidence a prediction starts with: the client says the answer repeats it


@dataclass(frozen=True)
class Gap:
    """Where an alignment was lost, to look for the target's next tokens near it."""

    pos: int  # the source position the target left
    context_len: int  # the context's length then


@dataclass(frozen=True)
class Rule:
    """A learnt substitution: where the source says `span`, the target writes `replacement`;
    seen: the target wrote it so (else a rename carried over from one it wrote, see _generalise)."""

    span: tuple[int, ...]
    replacement: tuple[int, ...]
    seen: bool = True


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
        """The rule, in place of any for the same span; a rule carried over from a rename never
        replaces one the target was seen to follow (`data` -> `payload` stays where a later
        `Data` -> `Record`, carried over to lower case, would make it `record`)."""
        if not rule.seen and any(r.span == rule.span and r.seen for r in self.table.get(rule.span[0], ())):
            return
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

    def cut(self, tokens: list[int], n: int) -> None:
        """Forget the n-grams followed at positions >= n of `tokens` (the list as indexed)."""
        for follower in range(max(n, 1), self.indexed):
            for size in self.sizes:
                if follower >= size:
                    key = tuple(tokens[follower - size : follower])
                    places = self.tables[size][key]
                    places.pop()  # (a key's followers are in order: those cut are its last ones)
                    if not places:
                        del self.tables[size][key]
        self.indexed = min(self.indexed, n)

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

    def keep_shared(self, context: list[int]) -> None:
        """Keep only what the conversation shares with `context` (an editor's next keystroke, a
        regenerated answer: what they share stays indexed, as a KV cache keeps its prefix)."""
        n = common_prefix(self.tokens, context, len(context))
        self.ngrams.cut(self.tokens, n)
        del self.tokens[n:]


class Alignment:
    """Where a copy stands in one source (the context, or the prediction), the way a diff aligns
    two files: at the next raw source token `pos` (None: lost, or never anchored), the
    substitution being followed, and where it was last lost."""

    def __init__(self, source: int) -> None:
        self.source = source
        self.name = SOURCE_NAMES[source]
        self.reset()

    def reset(self) -> None:
        self.pos: int | None = None
        self.pending: list[int] = []  # a substitution's tokens still expected before the source's token at pos
        self.rule_at: RuleInUse | None = None  # the substitution being followed
        self.gap: Gap | None = None
        self.lost_evidence = 0  # how long the alignment had held when it was lost
        self.evidence = 0  # tokens agreed since it was set
        self.followed = 0  # how far into the source the target has followed it

    def set(self, pos: int, evidence: int) -> None:
        self.pos, self.evidence = pos, evidence
        self.followed = max(self.followed, pos)

    def lose(self, at: int, context_len: int, at_least: int) -> None:
        self.gap, self.lost_evidence = Gap(at, context_len), max(self.evidence, at_least)
        self.pos, self.pending, self.rule_at, self.evidence = None, [], None, 0


@dataclass(frozen=True)
class Alternative:
    """Text that followed the context's last n-gram at some of the places it occurs: a branch of
    a copy's tree. share: of those places, the part followed by it."""

    tokens: list[int]
    share: float


@dataclass(frozen=True)
class Lookup:
    """What one source says comes next, and how long its alignment has held."""

    draft: Draft
    evidence: int


class CopyDrafter(Drafter):
    """Copies ahead from source texts, aligned to each the way a diff aligns two files.

    One per request. Sources: the context (prompt and output so far) and a predicted output
    (OpenAI's Predicted Outputs: text the answer will largely repeat), each with an alignment
    of its own, so that both draft every round (lookups(); the controller takes the one that
    promises more). An alignment follows the target token by token; while they agree, drafts
    are what comes next there (long, up to `max_tokens`). When the target writes something
    else, the alignment is lost, and it re-anchors on the target's own next tokens near where
    it was, so a skipped, inserted or replaced word costs a round or two instead of a fresh
    long n-gram; failing that, on the longest n-gram match anywhere in its source. What the
    target wrote in place of a source span becomes a substitution applied to later drafts
    from either source (the source says `items`, the target wrote `records`: later drafts say
    `records`), dropped if the target disagrees. Drafts are deterministic: point masses. The
    alignments move only in begin() and accept(); lookups() and draft() read them.

    An alignment's `evidence` (tokens agreed since it was set) tells the controller how far to
    trust its draft. A prediction starts with PREDICTION_CREDIT of it, the client's word (and with
    the fence the prompt quotes it in, if it does: the answer will open with it too)."""

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
        self.alignments = [Alignment(CONTEXT)] + ([Alignment(PREDICTION)] if prediction else [])
        self.rules = Substitutions()
        self._outcomes: list[CopyOutcome] = []

    # --- the Drafter protocol ---------------------------------------------------
    def begin(self, prompt: list[int]) -> None:
        """The request's prompt: the answer starts at the beginning of the prediction, if any."""
        self._follow(prompt)
        self._outcomes.clear()
        for alignment in self.alignments:
            alignment.reset()
            if alignment.source == PREDICTION:  # the client says the answer repeats it
                self._wrap_as_quoted()
                alignment.set(0, PREDICTION_CREDIT)
            else:
                self._anchor(alignment)

    def accept(self, context: list[int]) -> None:
        """Take in the tokens the context gained, moving the alignments along (and anchoring them
        again where they were lost)."""
        self._follow(context)
        for alignment in self.alignments:
            if alignment.pos is None:
                self._anchor(alignment)

    def _wrap_as_quoted(self) -> None:
        """Where the prompt quotes the prediction's beginning in a fenced block (an edit request
        quoting the file), the answer will open with the same fence: the prediction gains it."""
        prediction, context, index = self.sources[PREDICTION], self.sources[CONTEXT], self.indexes[CONTEXT]
        n = next((n for n in index.sizes if n <= len(prediction)), None)
        if self.vocab is None or n is None or not (found := index.tables[n].get(tuple(prediction[:n]))):
            return
        start = found[-1] - n  # where the quote begins, after its fence's newline
        line = max(start - 1, 0)
        while line > 0 and b"\n" not in self.vocab.piece(context[line - 1]):
            line -= 1  # back to the beginning of the line before the quote
        fence = context[line:start]
        if b"".join(map(self.vocab.piece, fence)).lstrip().startswith(b"```"):
            prediction[:0] = fence
            self.indexes[PREDICTION].clear()
            self.indexes[PREDICTION].extend(prediction)

    def outcomes(self) -> list[CopyOutcome]:
        """What the copies expected of each token the context gained since the last call, against
        what the target wrote: the copies' acceptance rates, measured free."""
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def lookups(self, n: int) -> list[Lookup]:
        """What each aligned source says comes next (up to n tokens; `context` as last followed)."""
        n = min(n, self.max_tokens)
        aligned = [a for a in self.alignments if a.pos is not None]
        return [Lookup(Draft(self._expected(a, n), None, source=a.name), a.evidence) for a in aligned]

    def alternatives(self, n: int) -> list[Alternative]:
        """What followed the context's last n-gram at every place in the sources it occurs, up to
        n tokens of each, the most frequent first: of the n-gram sizes, the longest after which the
        text went on in more than one way (a tree's other branches; none where it never did)."""
        context = self.sources[CONTEXT]
        for size in self.indexes[CONTEXT].sizes:
            if size >= len(context):
                continue
            found: dict[tuple[int, ...], int] = {}
            for source, index in zip(self.sources, self.indexes, strict=True):
                for q in index.tables[size].get(tuple(context[-size:]), ())[-ALTERNATIVE_PLACES:]:
                    text = tuple(source[q : q + n])
                    found[text] = found.get(text, 0) + 1
            if len({text[:1] for text in found if text}) > 1:
                places = sum(found.values())
                ranked = sorted(found.items(), key=lambda item: -item[1])
                return [Alternative(list(text), count / places) for text, count in ranked if text]
        return []

    def draft(self, context, n, params=None, rng=None, stop_below=(), grammar=None) -> Draft:
        """The draft of the source whose alignment has held longest (the controller weighs them all: lookups())."""
        found = [lookup for lookup in self.lookups(n) if lookup.draft.tokens]
        if not found:
            return Draft([], None, source=SOURCE_NAMES[CONTEXT])
        return max(found, key=lambda lookup: lookup.evidence).draft

    # --- following the target ---------------------------------------------------
    def _follow(self, context: list[int]) -> None:
        seen = self.sources[CONTEXT]
        if not self.conversation.continued_by(context):  # another conversation, or another turn of it
            self.conversation.keep_shared(context)
            for alignment in self.alignments:
                alignment.reset()
        for token in context[len(seen) :]:
            seen.append(token)
            for alignment in self.alignments:
                if alignment.pos is not None:
                    self._step(alignment, token)
        self.indexes[CONTEXT].extend(seen)

    def _step(self, a: Alignment, token: int) -> None:
        expected = self._peek(a)
        self._outcomes.append(CopyOutcome(a.name, a.evidence, expected == token))
        if expected == token:
            if a.pending:
                a.pending.pop(0)
            else:
                a.set(a.pos + 1, a.evidence)
            a.evidence += 1
            return
        if a.pending and len(a.pending) == len(a.rule_at.rule.replacement):  # a substitution, not begun
            start = a.rule_at.start
            if self.sources[a.source][start] == token:  # the substitution was wrong here: forget it, copy as is
                self.rules.forget(a.rule_at.rule.span)
                a.pending = []
                a.set(start + 1, a.evidence + 1)
                return
        # the client said the answer repeats the prediction: once lost there, always look nearby
        at_least = MIN_LOST if a.source == PREDICTION else 0
        a.lose(a.rule_at.start if a.pending else a.pos, len(self.sources[CONTEXT]) - 1, at_least)

    def _peek(self, a: Alignment) -> int | None:
        """The next token the source (with substitutions) expects; starts a substitution if one applies."""
        if a.pending:
            return a.pending[0]
        tokens, i = self.sources[a.source], a.pos
        while i < len(tokens) and (rule := self.rules.match(tokens, i)):
            a.rule_at, i = RuleInUse(i, rule), i + len(rule.span)
            a.pos = i
            if rule.replacement:
                a.pending = list(rule.replacement)
                return a.pending[0]
        return tokens[i] if i < len(tokens) else None

    def _expected(self, a: Alignment, n: int) -> list[int]:
        """Up to n tokens the source expects next, substitutions applied."""
        out = a.pending[:n]
        tokens, i = self.sources[a.source], a.pos
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
        """A renamed identifier is renamed in every token it appears in whole: ` items` ->
        ` records` also gives `(items` -> `(records` and `Items` -> `Records` for the tokens of
        the sources. Only whole identifiers: a stem carried over to other forms guesses wrong
        (`records` -> `entries` is not `record` -> `entrie`), so does a part of a longer name
        (renaming `area` leaves `circle_area`), and the target teaches the others where it
        writes them."""
        old, new = (b"".join(map(self.vocab.piece, t)).decode("utf-8", "replace") for t in (span, replacement))
        old, new = _without_common_ends(old, new)
        if len(old) < MIN_RENAME or not old.isidentifier() or not new.isidentifier():
            return
        variants = {old: new, old.lower(): new.lower(), old.capitalize(): new.capitalize(), old.upper(): new.upper()}
        words = re.compile("|".join(rf"(?<!\w){re.escape(a)}(?!\w)" for a in variants))
        for token in set(self.sources[CONTEXT]) | set(self.sources[PREDICTION]):
            text = self.vocab.piece(token).decode("utf-8", "replace")
            renamed = words.sub(lambda m: variants[m.group()], text)
            if renamed != text and (token,) != tuple(span):
                self.rules.add(Rule((token,), tuple(self.vocab.tokenize(renamed, add_special=False)), seen=False))

    # --- anchoring ----------------------------------------------------------------
    def _anchor(self, a: Alignment) -> None:
        """Point into the source again: near where the alignment was lost, else anywhere."""
        context = self.sources[CONTEXT]
        gap = a.gap
        if gap and a.lost_evidence >= MIN_LOST and len(context) - gap.context_len <= LOCAL_SPAN:
            if self._anchor_near(a, gap) or a.source == PREDICTION:
                return  # lost in the prediction, the answer is expected back there soon: wait for it
        self._anchor_anywhere(a)

    def _anchor_near(self, a: Alignment, gap: Gap) -> bool:
        lost_at, lost_len = gap.pos, gap.context_len
        context, tokens = self.sources[CONTEXT], self.sources[a.source]
        for k, reach in LOCAL_REACH:
            if k > len(context):
                continue
            suffix = context[-k:]
            # positions q just past a copy of the suffix, nearest to the loss first (forward on ties)
            # (in the context itself, only before the loss: after it is the target's own new text)
            end = lost_len if a.source == CONTEXT else len(tokens) - 1
            lo, hi = max(k, lost_at - LOCAL_BACK + k), min(end, lost_at + reach + k)
            for q in sorted(range(lo, hi + 1), key=lambda q: (abs(q - k - lost_at), q < lost_at + k)):
                if tokens[q - k : q] == suffix:
                    # what the target wrote between the loss and this anchor replaced that source span
                    self._learn(tokens[lost_at : q - k], context[lost_len : len(context) - k])
                    # a long alignment found again just past a small edit still counts (all of
                    # it in a prediction: the client said the answer repeats it)
                    keeps = 1.0 if a.source == PREDICTION else REANCHOR_KEEPS
                    a.set(q, max(k, int(a.lost_evidence * keeps)))
                    return True
        return False

    def _anchor_anywhere(self, a: Alignment) -> None:
        """The longest n-gram ending the context that occurs in the source: in the prediction its
        next occurrence past where it was followed to, in the context its latest."""
        context, index = self.sources[CONTEXT], self.indexes[a.source]
        for n in index.sizes:
            if n >= len(context):
                continue
            if found := index.tables[n].get(tuple(context[-n:])):
                at = next((q for q in found if q >= a.followed), found[-1]) if a.source == PREDICTION else found[-1]
                a.set(at, n)
                return


def branched(draft: Draft, alternatives: list[Alternative], alpha: float, branching: Branching) -> tuple[Draft, float]:
    """A copy `draft` (a chain) grown into a tree by the alternatives, each grafted where it
    parts from what the tree holds, no deeper than the draft. A node is added while its chance
    of being reached and taken beats what one more token in the verify pass costs
    (branching.cost(k), the pass's k tokens); a pass verifies TREE_BRANCHES + 1 branches at most.
    A node is taken where its parent is with chance α, a copied token; where it parts, the
    alternative's share, but no more than the copy's 1 - α, weighed by the trust learnt for its
    rank (how often the target took such siblings against those chances: Draft.chances).
    Returns the tree (a chain where nothing was worth adding) and the tokens it adds to a
    round's expected yield, its nodes' chances."""
    tokens, parents = list(draft.tokens), list(range(-1, len(draft.tokens) - 1))
    chances = [alpha] * len(tokens)  # each node's, of being taken where its parent is (as judged, untrusted)
    trusted = list(chances)  # ... weighed by its rank's trust (what the shape is chosen by)
    nodes = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens, strict=True))}
    gain = 0.0
    for alternative in alternatives:
        node, reached = -1, 1.0  # reached: the round's chance of reaching the next token
        for token in alternative.tokens[: len(draft.tokens)]:
            if (child := nodes.get((node, token))) is None:
                rank = parents.count(node)  # its parent's children so far (0: it lengthens a branch)
                chance = min(alternative.share, 1.0 - alpha) if rank else alpha
                trust = branching.trust[min(rank, len(branching.trust)) - 1] if rank else 1.0
                own = min(chance * trust, 1.0)
                if reached * own < branching.cost(len(tokens) + 1) or (rank and leaves(parents) > TREE_BRANCHES):
                    break
                child = nodes[node, token] = len(tokens)
                tokens.append(token)
                parents.append(node)
                chances.append(chance)
                trusted.append(own)
                gain += reached * own
            reached *= trusted[child]
            node = child
    if len(tokens) == len(draft.tokens):
        return Draft(tokens, None, source=draft.source), gain
    return Draft(tokens, None, source=draft.source, parents=parents, chances=chances), gain


def _without_common_ends(old: str, new: str) -> tuple[str, str]:
    """The two texts without the punctuation and spaces they begin and end with alike."""
    start = 0
    while start < min(len(old), len(new)) and old[start] == new[start] and not old[start].isalnum():
        start += 1
    end = 0
    while end < min(len(old), len(new)) - start and old[-1 - end] == new[-1 - end] and not old[-1 - end].isalnum():
        end += 1
    return old[start : len(old) - end], new[start : len(new) - end]
