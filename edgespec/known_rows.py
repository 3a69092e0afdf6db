"""The target's rows that an answer was drawn from, kept for the answers to the same prompt after it.

llama.vscode asks for three answers at every keystroke (n_cmpl), a user regenerates an answer,
a script sends the same prompt again: each answer is drawn anew from the target's law, and
where it goes the way an earlier one went, the law at each of its positions is a row the
target has already computed (the same tokens before it). The rows of an answer's first tokens
are kept (the latest answer to each of the last MAX_PROMPTS prompts), and a run whose answer so
far follows one of those paths verifies the rest of the path as a draft whose target rows are in
hand (Run.rounds): its tokens are drawn as a pass would draw them, and an answer that comes out
equal to one already made costs nothing more than the draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_BYTES = 48 << 20  # of rows kept, all prompts together (a Qwen2.5 row: 594 KiB, so 41 rows a prompt)
MAX_PROMPTS = 2  # an editor's latest keystroke and one other request beside it


@dataclass(frozen=True)
class Ahead:
    """What is known after a sequence: the known path's next tokens (a draft) and the target's rows
    after the sequence and after each of them (len(tokens) + 1 rows)."""

    tokens: list[int]
    rows: np.ndarray


@dataclass(eq=False)  # each path is itself
class KnownPath:
    """An answer's first tokens after its prompt: rows[i] is the target's row after
    tokens[: start + i], and tokens[start + i] was drawn from it (rows[:filled] hold them)."""

    tokens: list[int]
    start: int
    rows: np.ndarray  # (max rows, n_vocab) float32, written once, read as views
    filled: int = 0

    def ahead(self, seq: list[int], room: int) -> Ahead | None:
        i = len(seq) - self.start
        if not 0 <= i < self.filled or seq != self.tokens[: len(seq)]:
            return None
        tokens = self.tokens[len(seq) : self.start + self.filled - 1][: max(0, room)]
        return Ahead(tokens, self.rows[i : i + len(tokens) + 1])


class KnownRows:
    """The kept paths of one target (its rows depend on nothing but the tokens before them)."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.max_rows = max(1, MAX_BYTES // (MAX_PROMPTS * n_vocab * np.dtype(np.float32).itemsize))
        self.paths: list[KnownPath] = []  # the latest last

    def ahead(self, seq: list[int], room: int) -> Ahead | None:
        """What is known after `seq` (an answer so far), if it follows a kept path: `room` tokens at most."""
        return next((known for path in self.paths if (known := path.ahead(seq, room)) is not None), None)

    def record(self, start: int, seq: list[int], new: list[int], rows: np.ndarray) -> None:
        """A round after `seq` (a prompt of `start` tokens and its answer so far) drew `new`, each
        from its row in `rows`: an answer's first round begins its prompt's path (the one before
        is dropped, its rows reused); a later one extends the path it is on, as far as max_rows."""
        if len(seq) == start:  # this prompt's last path, or else the oldest where all are taken, makes room
            old = [p for p in self.paths if p.tokens[:start] == seq] or self.paths[: len(self.paths) + 1 - MAX_PROMPTS]
            self.paths = [p for p in self.paths if all(p is not o for o in old)]
            buffer = old[0].rows if old else np.empty((self.max_rows, self.n_vocab), np.float32)
            self.paths.append(KnownPath(list(seq), start, buffer))
        on = (p for p in self.paths if p.start == start and len(p.tokens) == len(seq) and p.tokens == seq)
        if (path := next(on, None)) is None:  # (an answer that left its path: the path stays)
            return
        taken = min(len(new), self.max_rows - path.filled)
        path.rows[path.filled : path.filled + taken] = rows[:taken]
        path.tokens += new[:taken]
        path.filled += taken
