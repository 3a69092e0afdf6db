"""What a grammar forces, drafted free."""

from __future__ import annotations

from ..grammar import MAX_FORCED_CHARS
from ..model import Model
from ..modes import Source
from .base import Draft, Drafter


class GrammarDrafter(Drafter):
    """Drafts what the grammar forces: where it allows one continuation only (a schema's
    keys, JSON punctuation, closing brackets), that text's tokens, as a point mass. Free
    (no model runs); the target still verifies them, since it may split the text into
    other tokens than the tokenizer does alone."""

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
