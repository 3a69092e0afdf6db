"""What an editor's requests share from one keystroke to the next (an engine keeps one Keystrokes):

- Heads (fim.Head), the prompts up to [MID] read lately. A request is laid out on the latest
  anchor whose head agrees with its text and is still cached (in the live cache or among the
  saved prompts): while the user types on a line, and after Enter, a keystroke reads only the
  text it typed. A request anchored above its cursor line leaves idle work: the head anchored at
  the cursor line, read while the engine is idle, so that a later keystroke finds it.
- Suggestions: the last answers, each after the text before its cursor. Where the user typed what
  was suggested (or took a little of it back), the rest is the next answer's predicted output: the
  whole line verified in one pass.
- The request after a suggestion is accepted (llama.vim's "speculative FIM": Tab, then the next
  line asked for) is answered while idle: its prompt is then cached and its answer is a suggestion
  for the real request, which Tab makes as good as immediate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .fim import FimPrompt, Head, Infill, head, layout, middle
from .request import Request
from .vocabulary import FimTokens, Vocabulary

MAX_HEADS = 4  # heads remembered (each is a prompt's tokens: a few thousand ints)
MAX_MIDDLE_LINES = 16  # an earlier anchor is looked for this many lines above the cursor line at most
MAX_SUGGESTIONS = 8
CONTEXT_CHARS = 1024  # of the text before a suggestion, kept to recognise where a later request's cursor is
PROBE_CHARS = 256  # a request's last characters looked for in a suggestion's text
MAX_TAKEN_BACK = 64  # characters a request's cursor may lie before a suggestion's start


@dataclass(frozen=True)
class Suggestion:
    """An answer and the text before its cursor (the last CONTEXT_CHARS characters), at one place of
    one file (its request's suffix and chunks)."""

    suffix: str
    chunks: tuple
    text: str  # the text before the cursor's tail, then the answer
    start: int  # where the answer begins in `text`

    def rest(self, infill: Infill) -> str:
        """What the suggestion still has after a request's cursor ("": nothing, or another place):
        the request's last characters must be found in it, ending within the answer or at most
        MAX_TAKEN_BACK characters before it."""
        if (infill.suffix, infill.chunks) != (self.suffix, self.chunks):
            return ""
        probe = infill.before[-PROBE_CHARS:]
        at = self.text.find(probe, max(0, self.start - MAX_TAKEN_BACK - len(probe)))
        return self.text[at + len(probe) :] if at >= 0 else ""


@dataclass(frozen=True)
class IdleWork:
    """A request to run while the engine is idle, and its prompt where it is not the request's own
    layout (a head to read)."""

    request: Request
    layout: FimPrompt | None = None


class Keystrokes:
    """The heads, suggestions and idle work of an engine's fill-in-the-middle requests."""

    def __init__(self, fim: FimTokens, vocab: Vocabulary, n_ctx: int, bos: int | None) -> None:
        self.fim, self.vocab, self.n_ctx, self.bos = fim, vocab, n_ctx, bos
        self.heads: list[Head] = []  # most recent first
        self.suggestions: list[Suggestion] = []  # most recent last
        self.idle: list[IdleWork] = []  # in order

    def prompt(self, infill: Infill, cached: Callable[[Sequence[int]], int]) -> FimPrompt:
        """The request's prompt on the latest anchor whose head fits and is cached (cached(tokens):
        how many of them the caches hold), else anchored at its cursor line (that head remembered)."""
        before, anchors = infill.before, [len(infill.prefix)]
        while len(anchors) <= MAX_MIDDLE_LINES and anchors[-1] > 0:
            anchors.append(before.rfind("\n", 0, anchors[-1] - 1) + 1)  # the line above's start
        for anchor in anchors:
            for known in self.heads:
                if known.fits(infill, anchor) and cached(known.tokens) >= len(known.tokens) - 1:
                    typed = middle(infill, anchor, self.vocab, n_ctx=self.n_ctx, prefix=known.prefix_length)
                    if typed is not None:
                        self._remember(known)
                        return FimPrompt(known, typed, anchor)
        prompt = layout(infill, self.fim, self.vocab, n_ctx=self.n_ctx, bos=self.bos)
        self._remember(prompt.head)
        return prompt

    def _remember(self, known: Head) -> None:
        """`known` first among the heads (once: a head planned again after a keystroke is the same)."""
        self.heads = [known] + [h for h in self.heads if h != known][: MAX_HEADS - 1]

    def prediction(self, infill: Infill) -> str:
        """The latest suggestion's rest after the request's cursor ("": none continues there)."""
        return next((rest for s in reversed(self.suggestions) if (rest := s.rest(infill))), "")

    def answered(self, request: Request, prompt: FimPrompt, answer: str, *, idle: bool = False) -> None:
        """A request's answer came: it is a suggestion for the keystrokes after it. A request's first
        answer (not idle work's) plans the idle work: the request after its suggestion is accepted, and
        where the request was anchored above its cursor line, the head anchored there."""
        infill = request.prompt
        if not answer:
            return
        context = infill.before[-CONTEXT_CHARS:]
        suggestion = Suggestion(infill.suffix, infill.chunks, context + answer, len(context))
        last = self.suggestions[-1] if self.suggestions else None
        place = (infill.suffix, infill.chunks, context)
        first = last is None or (last.suffix, last.chunks, last.text[: last.start]) != place
        self.suggestions = [*self.suggestions[1 - MAX_SUGGESTIONS :], suggestion]
        if idle or not first:  # (the n_cmpl answers after a request's first plan nothing more)
            return
        accepted = Infill.at_cursor(infill.before + answer, infill.suffix, infill.chunks)
        self.idle = [IdleWork(replace(request, prompt=accepted, prediction=None))]
        # the head first: what it reads is kept when a keystroke interrupts it, and without it the
        # middle grows until it must be read whole
        if prompt.anchor < len(infill.prefix):  # a head at the cursor line, holding the same lines and those since
            since = infill.before[prompt.anchor : len(infill.prefix)]
            fresh = head(
                infill,
                len(infill.prefix),
                self.fim,
                self.vocab,
                n_ctx=self.n_ctx,
                bos=self.bos,
                prefix=prompt.head.prefix_text + since,
            )
            self.idle.insert(0, IdleWork(replace(request, max_tokens=0), FimPrompt(fresh, [], len(infill.prefix))))

    def next_idle(self) -> IdleWork | None:
        """The next idle work (a head it reads is remembered: a keystroke uses it once it is read)."""
        if not self.idle:
            return None
        work = self.idle.pop(0)
        if work.layout is not None:
            self._remember(work.layout.head)
        return work

    def forget(self) -> None:
        self.heads, self.suggestions, self.idle = [], [], []
