"""Token bytes -> printable text, safe to stream.

A multi-byte character can be split across tokens and a stop string across
several tokens; nothing is released until it can no longer turn into either.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._pending = ""
        self.stopped: str | None = None  # the stop string that ended the text

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to show.
        After a stop string appears, `stopped` is set to it and the stop string and
        everything after it are dropped."""
        self._pending += self._decoder.decode(piece)
        hits = [(at, s) for s in self._stop if (at := self._pending.find(s)) >= 0]
        if hits:
            at, self.stopped = min(hits)
            text, self._pending = self._pending[:at], ""
            return text
        # hold back the longest tail that could still grow into a stop string
        hold = max((k for s in self._stop for k in range(1, len(s)) if self._pending.endswith(s[:k])), default=0)
        cut = len(self._pending) - hold
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text

    def flush(self) -> str:
        """The rest at the end of generation (an incomplete character becomes U+FFFD)."""
        if self.stopped:
            return ""
        text, self._pending = self._pending + self._decoder.decode(b"", final=True), ""
        return text
