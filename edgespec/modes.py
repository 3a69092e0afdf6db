"""What a request may speculate with (DraftMode) and where a round's draft came from (Source).

Pure Python: the shells check their settings against these before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import EdgespecError

AUTO = "auto"  # a draft length chosen per round


class _Name(str, Enum):
    """A name that is also its string (in f-strings, JSON and comparisons with str), on Python 3.10 too."""

    def __str__(self) -> str:
        return self.value


class DraftMode(_Name):
    AUTO = "auto"  # any drafter or none, chosen per round
    MODEL = "model"
    COPY = "copy"  # the free drafters: copies from the context, a prediction or the memory; forced text
    HYBRID = "hybrid"  # a confident copy, else the model
    OFF = "off"  # the target alone

    @property
    def needs_model(self) -> bool:
        return self in (DraftMode.MODEL, DraftMode.HYBRID)

    @property
    def sources(self) -> tuple[Source, ...]:
        """The drafters this mode may draw on (Source.COPY stands for the copy drafter, whose
        drafts come from the context or the prediction)."""
        free = (Source.COPY, Source.MEMORY, Source.GRAMMAR)
        return {
            DraftMode.AUTO: (*free, Source.MODEL),
            DraftMode.MODEL: (Source.MODEL,),
            DraftMode.COPY: free,
            DraftMode.HYBRID: (*free, Source.MODEL),
            DraftMode.OFF: (),
        }[self]


class Source(_Name):
    """Who made a round's draft: the counts in Stats are keyed by these."""

    OFF = "off"  # no draft: a plain target step
    MODEL = "model"
    HEADS = "heads"  # the target's own multi-token-prediction layers (in the draft model's place)
    COPY = "copy"  # copied from the context
    PREDICTION = "prediction"  # copied from the request's predicted output
    GRAMMAR = "grammar"  # the text the request's grammar forces
    MEMORY = "memory"  # what followed the context's end in earlier requests (memory.py)

    @property
    def free(self) -> bool:
        """Made without running a model: its acceptance is learnt from every token the target writes."""
        return self in (Source.COPY, Source.PREDICTION, Source.GRAMMAR, Source.MEMORY)


MODES = tuple(DraftMode)


def draft_mode(mode: str) -> DraftMode:
    try:
        return DraftMode(mode)
    except ValueError:
        raise EdgespecError(f"unknown draft mode '{mode}'; use one of {', '.join(MODES)}") from None


def check_mode(mode: str, *, has_model: bool) -> DraftMode:
    mode = draft_mode(mode)
    if mode.needs_model and not has_model:
        raise EdgespecError(f"draft mode '{mode}' needs a draft model; give a pair or --draft, or use copy")
    return mode


def draft_modes(*, has_model: bool) -> tuple[DraftMode, ...]:
    """The draft modes an engine can speculate with: without a draft model, those that need none."""
    return tuple(m for m in DraftMode if m is not DraftMode.OFF and (has_model or not m.needs_model))


@dataclass(frozen=True)
class Gamma:
    """A draft length: `fixed` tokens every round, or (None) chosen per round ("auto")."""

    fixed: int | None = None

    @classmethod
    def of(cls, value: Gamma | int | str) -> Gamma:
        """A draft length from an integer >= 1 or "auto" (an EdgespecError naming what is wrong)."""
        if isinstance(value, Gamma) or value == AUTO:
            return value if isinstance(value, Gamma) else cls()
        if isinstance(value, bool) or not isinstance(value, int):
            raise EdgespecError(f'gamma must be an integer or "auto", got {value!r}')
        if value < 1:
            raise EdgespecError(f"gamma must be >= 1, got {value}; use --no-draft to switch speculation off")
        return cls(value)

    @property
    def value(self) -> int | str:
        """As JSON and the shells show it: the number, or "auto"."""
        return AUTO if self.fixed is None else self.fixed

    def __str__(self) -> str:
        return str(self.value)


def adaptive(mode: DraftMode, gamma: Gamma) -> bool:
    """Whether rounds are planned by cost (what the drafter or the draft length is left to
    choose), rather than drafting exactly as told."""
    return mode is not DraftMode.OFF and (mode is DraftMode.AUTO or gamma.fixed is None)
