"""Fill-in-the-middle: what an editor's completion asks for (the code before the cursor, the
code after it, snippets of other files), laid out in the model's own FIM tokens so that what a
keystroke changes comes last:

    [REP]myproject⏎ [SEP]file⏎ chunk ... [SEP]filename⏎ [PRE]prefix [SUF]suffix [MID]typed

The prefix runs up to an anchor (the start of the cursor line, or of a line above it that an
earlier request anchored on), the suffix is the rest of the cursor line and the lines below, and
the text typed since the anchor comes after [MID], as a middle already begun: what the model saw
in training is the middle so far, then its continuation. Everything up to [MID] (the head) stays
the same while the user types, so a keystroke reads only its new tokens (keystrokes.py keeps the
heads read and chooses the anchor; the middle's last word is healed, healing.py). Qwen2.5-Coder's
repo-level pattern (arXiv 2409.12186) and llama-server's budgets, for its default 2048-token batch
(a context under 4096 tokens: from half of it): the prefix's last 1536 tokens, the suffix's first
510, the middle's last 256 at most, the chunks' last tokens within what the context leaves after
those and 256 tokens for the answer. The budgets depend on nothing a keystroke changes, so the
head stays the same token for token. A head read after a line change keeps its predecessor's
prefix and the lines typed since (so the two share their tokens, and only the new lines are
read): its prefix may run over the budget by up to half the middle's, which gives up as much, and
where it would run over by more it is cut again, lower, so that the heads after it grow a while.

llama-server puts the cursor line at the end of the prefix instead ([PRE]prefix+typed [SUF]suffix
[MID]), so that every keystroke reads the cursor line and the whole suffix again (about 500 tokens
with an editor's 64 lines below: 8 s on a 2-core CPU). The middle's form lost answers before it was
healed: its last word is a token cut short ("sel" of "self"), which the model reads as a word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import EdgespecError
from .vocabulary import FimTokens, Vocabulary

FIM_BATCH = 2048  # llama-server's default batch, which its budgets are cut from
ANSWER_ROOM = 256  # tokens kept for the answer: twice llama.vscode's n_predict (llama-server keeps twice the request's)
PROJECT = "myproject\n"  # the repository name llama-server writes
CURRENT_FILE = "filename\n"  # and the file name of the one being edited
# between chunks for models without a file separator: llama-server's "--- snippet ---"
SNIPPET = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class Chunk:
    """A snippet of another file (llama.vscode sends the ones around recent edits and yanks)."""

    text: str
    filename: str = "tmp"


@dataclass(frozen=True)
class Infill:
    """A completion at the cursor. prefix: the text before the cursor (llama.vscode: the lines
    above); cursor_line: more of it (llama-server's `prompt`: the cursor line up to the cursor),
    the middle already begun; suffix: the text after the cursor; chunks: snippets of other files."""

    prefix: str
    suffix: str
    cursor_line: str = ""
    chunks: Sequence[Chunk] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))  # frozen: set once, here
        texts = (self.prefix, self.suffix, self.cursor_line, *(c.text for c in self.chunks))
        if not all(isinstance(t, str) for t in (*texts, *(c.filename for c in self.chunks))):
            raise EdgespecError("a fill-in-the-middle prompt's prefix, suffix, cursor line and chunks must be text")

    @classmethod
    def at_cursor(cls, before: str, after: str, chunks: Sequence[Chunk] = ()) -> Infill:
        """The completion between two texts (OpenAI's prompt and suffix): the last line of
        `before` is the cursor line."""
        start = before.rfind("\n") + 1
        return cls(before[:start], after, before[start:], chunks)

    @property
    def before(self) -> str:
        """All the text before the cursor."""
        return self.prefix + self.cursor_line

    @property
    def chars(self) -> int:
        return sum(len(t) for t in (self.prefix, self.suffix, self.cursor_line, *(c.text for c in self.chunks)))


@dataclass(frozen=True)
class Budgets:
    """Tokens of each part of the prompt at most (see the module docstring)."""

    prefix: int
    suffix: int
    middle: int
    chunks: int

    @property
    def longest_prefix(self) -> int:
        """A head's prefix at most: the budget and half the middle's (see the module docstring)."""
        return self.prefix + self.middle // 2

    def middle_after(self, prefix: int) -> int:
        """The middle's budget after a prefix of `prefix` tokens: what the prefix left of the two."""
        return self.middle - max(0, prefix - self.prefix)

    @classmethod
    def of(cls, n_ctx: int) -> Budgets:
        batch = min(FIM_BATCH, n_ctx // 2)  # a small context keeps room for the chunks and the answer
        middle = batch // 8
        # BOS and the three FIM tokens, prefix, suffix and middle take batch + 2 + middle at most: the
        # chunks get the rest less room for an answer (bounds, not the rest's length nor the request's
        # n_predict, so that the next keystroke, or the request after a warm-up of n_predict 0, finds
        # the chunks, the head of the cache, as they were)
        return cls(3 * (batch // 4), batch // 4 - 2, middle, max(0, n_ctx - (batch + 2) - middle - ANSWER_ROOM))


@dataclass(frozen=True)
class Head:
    """A prompt up to its [MID], for one anchor: what stays in the cache while the user types after
    the anchor. prefix_text: the text before the anchor that it holds (from a line start), in
    prefix_length tokens; suffix and chunks: those of the requests it was made for."""

    tokens: tuple[int, ...]
    prefix_text: str
    suffix: str
    chunks: tuple[Chunk, ...]
    prefix_length: int

    def fits(self, infill: Infill, anchor: int) -> bool:
        """Whether a request's text agrees with this head with its anchor at `anchor` (an index of
        infill.before): the same suffix and chunks, and the text before the anchor the same as far
        as both go; an editor sends a window of lines, so either may begin later, but the request's
        by a few lines at most (a quarter of the head's text)."""
        if infill.suffix != self.suffix or infill.chunks != self.chunks:
            return False
        before = infill.before[:anchor]
        if before.endswith(self.prefix_text):
            return True
        return 4 * len(before) >= 3 * len(self.prefix_text) and self.prefix_text.endswith(before)


@dataclass(frozen=True)
class FimPrompt:
    """A fill-in-the-middle prompt: its head and the middle typed since its anchor (the cursor
    line, or more where an earlier anchor is kept: `anchor` is its index in the request's text)."""

    head: Head
    middle: list[int]
    anchor: int

    @property
    def tokens(self) -> list[int]:
        return [*self.head.tokens, *self.middle]


def head(
    infill: Infill,
    anchor: int,
    fim: FimTokens,
    vocab: Vocabulary,
    *,
    n_ctx: int,
    bos: int | None,
    prefix: str | None = None,
) -> Head:
    """The head of the request's prompt with its anchor at `anchor`; bos: where the model wants one.
    prefix: the text before the anchor it is to hold (an earlier head's and the lines typed since,
    so that the two share their tokens), up to Budgets.longest_prefix tokens; None: the lines
    nearest the anchor that fit the budget; too long: those that fit half the middle's less."""
    budgets = Budgets.of(n_ctx)
    extra: list[int] = []
    if fim.repo is not None:
        extra += [fim.repo, *vocab.text_tokens(PROJECT)]
    for chunk in infill.chunks:
        separator = [fim.file_sep, *vocab.text_tokens(chunk.filename + "\n")] if fim.file_sep is not None else None
        extra += separator or vocab.text_tokens(SNIPPET)
        extra += vocab.text_tokens(chunk.text)
    if fim.file_sep is not None:
        extra += [fim.file_sep, *vocab.text_tokens(CURRENT_FILE)]
    extra = extra[max(0, len(extra) - budgets.chunks) :]
    if prefix is None:
        prefix, tokens = _nearest_lines(infill.before[:anchor], vocab, budgets.prefix)
    elif len(tokens := vocab.text_tokens(prefix)) > budgets.longest_prefix:
        # cut lower than the budget, by what a prefix may run over it: the heads after this one grow a while
        prefix, tokens = _nearest_lines(infill.before[:anchor], vocab, budgets.prefix - budgets.middle // 2)
    suffix = vocab.text_tokens(infill.suffix)[: budgets.suffix]
    head = (*extra, *([bos] if bos is not None else []), fim.prefix, *tokens, fim.suffix, *suffix, fim.middle)
    return Head(head, prefix, infill.suffix, infill.chunks, len(tokens))


def _nearest_lines(text: str, vocab: Vocabulary, budget: int) -> tuple[str, list[int]]:
    """The end of `text` that fits `budget` tokens, from a line start (from within its first line
    where no line start fits), and its tokens: a later head that holds the same lines and more
    shares their tokens."""
    tokens = vocab.text_tokens(text)
    while len(tokens) > budget:
        over = len(b"".join(map(vocab.piece, tokens[: len(tokens) - budget])))
        cut = len(text.encode()[:over].decode("utf-8", "ignore"))
        line = text.find("\n", cut, len(text) - 1) + 1  # (a line start that leaves some text)
        text = text[line or max(cut, 1) :]
        tokens = vocab.text_tokens(text)
    return text, tokens


def middle(infill: Infill, anchor: int, vocab: Vocabulary, *, n_ctx: int, prefix: int = 0) -> list[int] | None:
    """The tokens of the text typed since the anchor (None: more than the middle's budget after a
    head's prefix of `prefix` tokens)."""
    tokens = vocab.text_tokens(infill.before[anchor:])
    return tokens if len(tokens) <= Budgets.of(n_ctx).middle_after(prefix) else None


def layout(infill: Infill, fim: FimTokens, vocab: Vocabulary, *, n_ctx: int, bos: int | None = None) -> FimPrompt:
    """The prompt anchored at the start of the cursor line (of a later character, where the cursor
    line up to the cursor is longer than the middle's budget: the longest tail that fits)."""
    anchor = len(infill.prefix)
    while (typed := middle(infill, anchor, vocab, n_ctx=n_ctx)) is None:
        anchor += (len(infill.before) - anchor + 1) // 2
    return FimPrompt(head(infill, anchor, fim, vocab, n_ctx=n_ctx, bos=bos), typed, anchor)
