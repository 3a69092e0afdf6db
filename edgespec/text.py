"""Token bytes -> printable text, safe to stream.

A multi-byte character can be split across tokens and a stop string across
several tokens; nothing is released until it can no longer turn into either.
With min_indent, a new line is held back until its first character shows whether
it is indented enough.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

INDENT = " \t"


class TextStream:
    def __init__(self, stop: Sequence[str] = (), min_indent: int = 0, skip: bytes = b"") -> None:
        """stop: strings that end the text (dropped with what follows); min_indent: a line after
        the first that starts with fewer spaces or tabs than this ends the text before it
        (llama-server's n_indent: an editor's completion stays inside the block being written);
        skip: the bytes the tokens begin with that are not the text's (a healed prompt's, which
        the answer writes again)."""
        self._skip = skip
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._min_indent = min_indent
        self._pending = ""
        self.stopped: str | None = None  # the stop string that ended the text
        self.under_indented = False  # a line indented less than min_indent ended the text

    @property
    def ended(self) -> bool:
        return self.stopped is not None or self.under_indented

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to show.
        After a stop string appears, `stopped` is set to it and the stop string and
        everything after it are dropped; after an under-indented line starts,
        `under_indented` is set and the text ends with the newline before it."""
        if self._skip:
            skipped = min(len(piece), len(self._skip))
            piece, self._skip = piece[skipped:], self._skip[skipped:]
        self._pending += self._decoder.decode(piece)
        hits = [(at, s) for s in self._stop if (at := self._pending.find(s)) >= 0]
        if hits:
            at, self.stopped = min(hits)
            text, self._pending = self._pending[:at], ""
            return text
        if (line := self._under_indented_line()) is not None:
            self.under_indented = True
            text, self._pending = self._pending[:line], ""
            return text
        # hold back the longest tail that could still grow into a stop string, or an indentation
        hold = max((k for s in self._stop for k in range(1, len(s)) if self._pending.endswith(s[:k])), default=0)
        if self._min_indent and (newline := self._pending.rfind("\n")) >= 0:
            if not self._pending[newline + 1 :].strip(INDENT):
                hold = max(hold, len(self._pending) - newline)
        cut = len(self._pending) - hold
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text

    def _under_indented_line(self) -> int | None:
        """Where, in the pending text, a line starts whose indentation is known and too small
        (any other character, a newline too, ends an indentation)."""
        if not self._min_indent:
            return None
        text, newline = self._pending, self._pending.find("\n")
        while newline >= 0:
            start = end = newline + 1
            while end < len(text) and text[end] in INDENT:
                end += 1
            if end < len(text) and end - start < self._min_indent:
                return start
            newline = text.find("\n", start)
        return None

    def flush(self) -> str:
        """The rest at the end of generation (an incomplete character becomes U+FFFD)."""
        if self.ended:
            return ""
        text, self._pending = self._pending + self._decoder.decode(b"", final=True), ""
        return text
