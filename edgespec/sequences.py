"""Which sequence of the engine's contexts each run holds.

The target's and the draft model's contexts hold `n_seq` sequences each (Model.use), one per
request answered at once; sequence i of the target goes with sequence i of the draft model. A
run holds one from its first pass to its end: the free one whose cache shares most of its
prompt (an editor's next keystroke finds the sequence its last one read), else the least
recently used; a start of its prompt that another sequence holds is copied over from it
(Cache.sync), so requests on one long system prompt read it once, and where another run that
began before it is still reading that start (two requests sent together), it waits for that
run's reading, then copies it (reading_ahead). A run never shares one:
two runs taking turns in one sequence would each read its prompt again after the other's
pass, and neither would get through a prefill; a library caller with more unfinished runs
than sequences is told so.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import EdgespecError
from .model import Model
from .prompt_cache import MIN_RESTORED, common_prefix


class Sequences:
    def __init__(self, models: Sequence[Model]) -> None:
        self.models = list(models)
        self.held: set[int] = set()
        self.reading: dict[int, list[int]] = {}  # held sequences whose runs read their prompts: in the order they began

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
        self.reading[seq] = prompt
        return seq

    def read(self, seq: int) -> None:
        """The run in `seq` has read its prompt."""
        self.reading.pop(seq, None)

    def release(self, seq: int) -> None:
        self.held.discard(seq)
        self.reading.pop(seq, None)

    def reading_ahead(self, seq: int, prompt: list[int], have: int) -> int | None:
        """Where a run that began reading before the one in `seq` is reading MIN_RESTORED more of
        `prompt` than the `have` tokens its cache holds, and has not read them yet: how many
        tokens that run's sequence holds now (its progress); else None. A recurrent state is
        copied only whole (Cache.sync): its readers are not waited for."""
        target = self.models[0]
        if target.recurrent:
            return None
        for other, reading in self.reading.items():
            if other == seq:
                return None  # the runs after it do not count: none waits for one that waits for it
            shared = common_prefix(reading, prompt, len(prompt) - 1)
            progress = len(target.sequence_tokens(other))
            if shared >= have + MIN_RESTORED and progress < shared:
                return progress
        return None

    def enter(self, seq: int) -> None:
        """The models work on sequence `seq` from now on."""
        for model in self.models:
            model.use(seq)
