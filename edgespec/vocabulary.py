"""What the token-level code needs of a model's vocabulary: the one Vocabulary protocol (a
Tokenizer has it; tests pass small stand-ins), and the fill-in-the-middle tokens it names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Vocabulary(Protocol):
    """A model's tokens as the samplers and prompt layouts read them: text as tokens (no special
    tokens added or parsed: an editor's text is data), a token's bytes, and its ends."""

    eot: int

    def text_tokens(self, text: str) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle tokens (None: it has none)."""

    prefix: int | None
    suffix: int | None
    middle: int | None
    repo: int | None = None  # a repository's name follows
    file_sep: int | None = None  # a file's name and text follow

    def missing(self) -> list[str]:
        """The names of the tokens a fill-in-the-middle prompt needs and this model lacks."""
        needed = {"prefix": self.prefix, "suffix": self.suffix, "middle": self.middle}
        return [name for name, token in needed.items() if token is None]
