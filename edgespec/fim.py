"""Fill-in-the-middle: what an editor's completion asks for (the code before the cursor, the
code after it, snippets of other files), laid out in the model's own FIM tokens the way
llama-server's /infill lays it out (the repo-level pattern of Qwen2.5-Coder's report,
arXiv 2409.12186):

    [REP]myproject⏎ [SEP]file⏎ chunk ... [SEP]filename⏎ [PRE]prefix cursor-line [SUF]suffix [MID]

The answer is the middle. Budgets as llama-server's (for its default 2048-token batch): the
prefix's last 1536 tokens, the suffix's first 510 less the cursor line's, and the chunks' last
tokens within what the context leaves after those and 256 tokens for the answer (a context
under 4096 tokens: budgets from half of it). The cursor line is tokenized apart from the
prefix, so a keystroke leaves the chunks and the prefix (and their cache) as they were, and
only the cursor line and the suffix are read again: about 500 tokens with an editor's 64
lines of suffix. Two layouts that read only 2-3 tokens a keystroke were measured on the
default pair and lost the answers: the suffix first (llama-server's --spm-infill) completed
none of 8 lines right, against 4 of 8 here (Qwen2.5-Coder is trained on this order); the
cursor line after [MID] none of 6, against 3 of 6, because its last word is a token cut
short ("sel" of "self"), which the model reads as a whole word (token healing would mend it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import EdgespecError

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
    above); cursor_line: more of it, tokenized apart (llama-server's `prompt`: the cursor line up
    to the cursor); suffix: the text after the cursor; chunks: snippets of other files."""

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
    def at_cursor(cls, before: str, after: str) -> Infill:
        """The completion between two texts (OpenAI's prompt and suffix): the last line of
        `before` is the cursor line."""
        start = before.rfind("\n") + 1
        return cls(before[:start], after, before[start:])

    @property
    def chars(self) -> int:
        return sum(len(t) for t in (self.prefix, self.suffix, self.cursor_line, *(c.text for c in self.chunks)))


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


def layout(
    infill: Infill,
    fim: FimTokens,
    tokenize: Callable[[str], list[int]],
    *,
    n_ctx: int,
    bos: int | None = None,
) -> list[int]:
    """The prompt's tokens (see the module docstring). tokenize: text -> tokens, no special
    tokens added or parsed (an editor's text is data); bos: where the model wants one."""
    extra: list[int] = []
    if fim.repo is not None:
        extra += [fim.repo, *tokenize(PROJECT)]
    for chunk in infill.chunks:
        extra += [fim.file_sep, *tokenize(chunk.filename + "\n")] if fim.file_sep is not None else tokenize(SNIPPET)
        extra += tokenize(chunk.text)
    if fim.file_sep is not None:
        extra += [fim.file_sep, *tokenize(CURRENT_FILE)]
    batch = min(FIM_BATCH, n_ctx // 2)  # a small context keeps room for the chunks and the answer
    prefix, suffix, cursor = tokenize(infill.prefix), tokenize(infill.suffix), tokenize(infill.cursor_line)
    prefix = prefix[max(0, len(prefix) - 3 * (batch // 4)) :]  # the text nearest the cursor
    suffix = suffix[: max(0, batch // 4 - (2 + len(cursor)))]
    # the chunks get what the rest leaves at most (BOS, the three FIM tokens, prefix, cursor line
    # and suffix take batch + 2 at most) less room for an answer: bounds, not the rest's length
    # nor the request's n_predict, so that the next keystroke (or the request after a warm-up
    # of n_predict 0) finds the chunks, the head of the cache, as they were
    extra = extra[max(0, len(extra) - max(0, n_ctx - (batch + 2) - ANSWER_ROOM)) :]
    head = [bos] if bos is not None else []
    return [*extra, *head, fim.prefix, *prefix, *cursor, fim.suffix, *suffix, fim.middle]
