"""Which sequence of the engine's contexts each run holds.

The target's and the draft model's contexts hold `n_seq` sequences each (Model.use), one per
request answered at once; sequence i of the target goes with sequence i of the draft model. A
run holds one from its first pass to its end: the free one whose cache shares most of its
prompt (an editor's next keystroke finds the sequence its last one read), else the least
recently used; a start of its prompt that another sequence holds is copied over from it
(Model.sync), so requests on one long system prompt read it once. A run never shares one:
two runs taking turns in one sequence would each read its prompt again after the other's
pass, and neither would get through a prefill; a library caller with more unfinished runs
than sequences is told so.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import EdgespecError
from .model import Model
from .prompt_cache import common_prefix


class Sequences:
    def __init__(self, models: Sequence[Model]) -> None:
        self.models = list(models)
        self.held: set[int] = set()

    @property
    def count(self) -> int:
        return self.models[0].n_seq

    def hold(self, prompt: list[int]) -> int:
        """A sequence for a run of this prompt, held until release()."""
        target = self.models[0]
        free = [i for i in range(self.count) if i not in self.held]
        if not free:
            raise EdgespecError(
                f"all {self.count} sequences hold answers under way; finish or close a stream before the next,"
                f" or load the engine with parallel={self.count + 1}"
            )
        seq = max(
            free, key=lambda i: (common_prefix(target.sequence_tokens(i), prompt, len(prompt)), -target.last_used(i))
        )
        self.held.add(seq)
        return seq

    def release(self, seq: int) -> None:
        self.held.discard(seq)

    def enter(self, seq: int) -> None:
        """The models work on sequence `seq` from now on."""
        for model in self.models:
            model.use(seq)
