"""The memory: every prompt and answer this machine has read and written, as tokens, per
vocabulary, kept across requests and restarts, so that what repeats across requests (a
regenerated answer, a script's similar jobs, an agent's re-read files) is drafted for free
(drafters/recall.py). Drafts are only ever verified: answers stay the target's.

One file per vocabulary (the tokenizer's identity: every model sharing it shares the memory)
in the cache folder's `memory/` (or $EDGESPEC_MEMORY_HOME), mode 0600, written atomically
(a temporary file renamed over it) under a lock: a save merges what this process learnt and
forgot into what is on disk now, so two processes on one memory keep each other's
sequences. Bounded by a cap in MiB, the oldest sequences forgotten first. A file that is
damaged, truncated or of another vocabulary is set aside with one line, and the program goes
on with an empty memory."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cache import cache_dir, locked, replace_atomically
from .prompt_cache import common_prefix
from .suffixes import DEPTH, SEPARATOR, TOKEN, Match, SuffixIndex

DEFAULT_MEMORY_MB = 128  # about 16 million tokens (8 bytes a token: see suffixes.py)
BYTES_PER_TOKEN = 8  # the token and its place in the suffix order
FORGET_TO = 0.9  # past the cap, the oldest sequences go until the memory is this share of it
RECENT = 16  # the latest sequences a new one is checked against (does it continue one of them?)
FORMAT = 1
STALE_S = 3600  # a temporary file this old is a save that was killed half-way (no save takes that long)
SUFFIX = ".npz"


class DamagedMemory(Exception):
    """A memory file that cannot be used as it is (why, in words)."""


def memory_dir() -> Path:
    if home := os.environ.get("EDGESPEC_MEMORY_HOME"):
        return Path(home)
    return cache_dir() / "memory"


def memory_wanted() -> bool:
    """Whether a process keeps a memory unless told (`EDGESPEC_MEMORY=off`: not, as --no-memory)."""
    return os.environ.get("EDGESPEC_MEMORY", "on").strip().lower() not in ("off", "0", "no", "false")


def vocabulary_id(tokenizer) -> str:
    """The tokenizer's identity: its type, special tokens and every token's text (as pairing
    tells whether two models share one)."""
    digest = hashlib.sha256(f"{tokenizer.vocab_type}/{tokenizer.bos}/{tokenizer.eos}/{tokenizer.n_vocab}".encode())
    for token in range(tokenizer.n_vocab):
        digest.update(tokenizer.token_text(token) + b"\0")
    return digest.hexdigest()[:24]


@dataclass
class Sequence:
    """One remembered text: its id (across processes), where it lies in the index, when it was
    remembered, by whom (the command: generate, chat, serve, library, ...), and where in the
    prompt and answer it begins (offset: what came before it is kept in another sequence)."""

    id: int
    start: int
    length: int
    time: float
    source: str
    offset: int = 0


@dataclass(frozen=True)
class Summary:
    """What a memory file holds, for `edgespec memory`."""

    path: Path
    models: list[str]
    tokens: int
    sequences: int
    bytes: int
    oldest: float | None
    newest: float | None
    by_source: dict[str, tuple[int, int]]  # source -> (sequences, tokens)


class Memory:
    """The remembered sequences of one vocabulary, indexed for the longest match (suffixes.py)."""

    def __init__(
        self,
        vocabulary: str,
        *,
        folder: Path | None = None,
        cap_mb: int = DEFAULT_MEMORY_MB,
        source: str = "library",
        model: str = "",
        persistent: bool = True,
    ) -> None:
        """vocabulary: vocabulary_id() of the models it serves; folder: where its file is (default
        memory_dir()); persistent=False: in this process only (nothing read or written); source:
        what the sequences remembered here are counted under; model: the file name shown for it."""
        if cap_mb < 1:
            raise ValueError("the memory's cap must be at least 1 MiB")
        self.vocabulary, self.cap_mb, self.source, self.model = vocabulary, cap_mb, source, model
        self.persistent = persistent
        self.path = (folder or memory_dir()) / f"{vocabulary}{SUFFIX}"
        self.index = SuffixIndex()
        self.sequences: list[Sequence] = []  # in the index's order
        self.models: set[str] = {model} if model else set()
        self._added: set[int] = set()  # ids remembered here since the last save
        self._forgotten: set[int] = set()  # ids forgotten here since the last save
        self._generation = ""  # the file's, as last read or written
        self.saved_at = time.monotonic()
        if persistent:
            self._read()

    # --- what is remembered --------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.sequences)

    @property
    def dirty(self) -> bool:
        return bool(self._added or self._forgotten)

    def remember(self, tokens: list[int]) -> None:
        """Keep `tokens` (a prompt and its answer). One that continues a recent sequence (the next
        turn of its conversation) replaces it, one that a recent sequence continues adds nothing,
        and one that begins as a recent one did is kept from a little before where it parts from
        it (a shared system prompt is kept once)."""
        if len(tokens) < 2:
            return
        kept_from = 0
        for old in self.sequences[-RECENT:]:
            text = self._text(old)
            shared = common_prefix(text, tokens[old.offset :], len(tokens))
            # parted at or before its offset (a shorter or another prompt): where, the sequence before it knows
            same = old.offset + shared if shared else 0
            if same == len(tokens):  # all of it is there already (a shorter answer to the same prompt)
                return
            if same == old.offset + len(text):  # its conversation's next turn
                self._forget([old])
                kept_from = max(kept_from, old.offset)
            elif same - DEPTH > kept_from:
                kept_from = same - DEPTH
        start = self.index.add(tokens[kept_from:])
        sequence = Sequence(secrets.randbits(63), start, len(tokens) - kept_from, time.time(), self.source, kept_from)
        self.sequences.append(sequence)
        self._added.add(sequence.id)
        self._keep_under_cap()

    def continued_by(self, prompt: list[int]) -> list[Sequence]:
        """The recent sequences `prompt` continues (its conversation's earlier turns)."""
        return [
            s
            for s in self.sequences[-RECENT:]
            if s.offset + s.length <= len(prompt) and self._text(s) == prompt[s.offset : s.offset + s.length]
        ]

    def longest(self, context: list[int], shortest: int, places: int, excluded: list[Sequence] = ()) -> Match | None:
        """The longest end of `context` remembered (suffixes.SuffixIndex.longest), outside `excluded`."""
        spans = np.array([(s.start, s.start + s.length + 1) for s in excluded], dtype=np.int64).reshape(-1, 2)

        def inside(positions: np.ndarray) -> np.ndarray:
            return ((positions[:, None] >= spans[:, 0]) & (positions[:, None] < spans[:, 1])).any(axis=1)

        return self.index.longest(context, shortest, places, inside if len(spans) else None)

    def clear(self) -> None:
        """Forget everything, here and on disk."""
        self._forget(list(self.sequences))
        self._added.clear()
        if self.persistent:
            with self._lock():
                self.path.unlink(missing_ok=True)
                self._generation = ""
            self._forgotten.clear()

    def _text(self, sequence: Sequence) -> list[int]:
        return self.index.text(sequence.start, sequence.length)

    def _forget(self, sequences: list[Sequence]) -> None:
        gone = {s.id for s in sequences}
        if not gone:
            return
        shift = self.index.remove([(s.start, s.start + s.length + 1) for s in sequences])
        self.sequences = [s for s in self.sequences if s.id not in gone]
        for s in self.sequences:
            s.start -= int(shift[s.start])
        self._forgotten |= gone - self._added
        self._added -= gone

    def _keep_under_cap(self) -> None:
        cap = self.cap_mb << 20
        if len(self.index) * BYTES_PER_TOKEN <= cap:
            return
        oldest, size = [], len(self.index) * BYTES_PER_TOKEN
        for s in sorted(self.sequences, key=lambda s: s.time):
            if size <= FORGET_TO * cap:
                break
            oldest.append(s)
            size -= (s.length + 1) * BYTES_PER_TOKEN
        self._forget(oldest)

    # --- on disk ---------------------------------------------------------------------------
    def save(self) -> None:
        """Write what this process learnt and forgot into the file (merged with what other
        processes wrote since it was read), atomically, under the memory's lock."""
        if not self.persistent or not self.dirty:
            return
        with self._lock():
            on_disk = self._load()
            if on_disk is None and self._generation:  # cleared (`edgespec memory --clear`) since it was read
                on_disk = ("", SuffixIndex(), [], set())
            if on_disk is not None and on_disk[0] != self._generation:  # another process wrote: merge
                self._merge(on_disk)
            self._write()
        self._added.clear()
        self._forgotten.clear()
        self.saved_at = time.monotonic()

    def save_or_say(self) -> None:
        """save(), where a failure (a full disk, a folder not writable) is said in one line: the
        memory stays in this process, and is not tried again until a while has passed."""
        try:
            self.save()
        except OSError as e:
            self.saved_at = time.monotonic()
            print(f"edgespec: the memory could not be saved ({e}); it is kept in this process", file=sys.stderr)

    def _merge(self, on_disk) -> None:
        """Become the file's memory less what this process forgot, plus what it learnt."""
        _, index, sequences, models = on_disk
        mine = [(s, self._text(s)) for s in self.sequences if s.id in self._added]
        self.index, self.sequences = index, sequences
        self.models |= models
        self._forget([s for s in self.sequences if s.id in self._forgotten])
        for s, text in mine:
            self.sequences.append(Sequence(s.id, self.index.add(text), s.length, s.time, s.source, s.offset))
        self._keep_under_cap()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._generation = secrets.token_hex(8)
        sources = sorted({s.source for s in self.sequences})
        meta = {
            "format": FORMAT,
            "vocabulary": self.vocabulary,
            "generation": self._generation,
            "models": sorted(self.models),
            "sources": sources,
        }
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):  # a save killed half-way
            if time.time() - stale.stat().st_mtime > STALE_S:
                stale.unlink(missing_ok=True)
        columns = {
            "meta": np.array(json.dumps(meta)),
            "tokens": self.index.tokens,
            "order": self.index.order,
            "ids": np.array([s.id for s in self.sequences], dtype=np.int64),
            "lengths": np.array([s.length for s in self.sequences], dtype=np.int64),
            "times": np.array([s.time for s in self.sequences], dtype=np.float64),
            "sources": np.array([sources.index(s.source) for s in self.sequences], dtype=np.int32),
            "offsets": np.array([s.offset for s in self.sequences], dtype=np.int64),
        }
        replace_atomically(self.path, lambda f: np.savez(f, **columns), mode=0o600)

    def _read(self) -> None:
        with self._lock():
            on_disk = self._load()
        if on_disk is not None:
            self._generation, self.index, self.sequences, models = on_disk
            self.models |= models

    def _load(self):
        """(generation, index, sequences, models) of the file; None where there is none, or it was
        damaged (then set aside, said in one line)."""
        if not self.path.exists():
            return None
        try:
            return read_file(self.path, self.vocabulary)
        except DamagedMemory as e:
            aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
            os.replace(self.path, aside)
            print(f"edgespec: the memory {self.path} {e}; set aside as {aside.name}, starting empty", file=sys.stderr)
            return None

    def _lock(self):
        return locked(f"memory-{self.vocabulary}", None)


def read_file(path: Path, vocabulary: str | None = None):
    """A memory file's (generation, index, sequences, models), checked whole; DamagedMemory
    naming what is wrong (vocabulary: the one it must be of; None: any)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {name: data[name] for name in ("tokens", "order", "ids", "lengths", "times", "sources", "offsets")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise DamagedMemory(f"cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DamagedMemory("is of an unknown format")
    if vocabulary is not None and meta.get("vocabulary") != vocabulary:
        raise DamagedMemory("is of another vocabulary")
    tokens, order, lengths = arrays["tokens"].astype(TOKEN), arrays["order"], arrays["lengths"]
    n = len(lengths)
    if any(len(arrays[name]) != n for name in ("ids", "times", "sources", "offsets")) or (lengths < 0).any():
        raise DamagedMemory("has a damaged sequence table")
    ends = np.cumsum(lengths + 1) - 1
    if int(lengths.sum()) + n != len(tokens) or (n and not (tokens[ends] == SEPARATOR).all()):
        raise DamagedMemory("has tokens that do not match its sequences")
    if (tokens == SEPARATOR).sum() != n:
        raise DamagedMemory("has tokens that do not match its sequences")
    suffixes = tokens != SEPARATOR
    if len(order) != suffixes.sum() or len(order) and (order.min() < 0 or order.max() >= len(tokens)):
        raise DamagedMemory("has a damaged suffix order")
    listed = np.zeros(len(tokens), dtype=bool)
    listed[order] = True
    if not np.array_equal(listed, suffixes):  # every token's suffix once (a permutation), no separator's
        raise DamagedMemory("has a damaged suffix order")
    index = SuffixIndex(tokens, order)
    if not index.ordered(sample=256):
        raise DamagedMemory("has a damaged suffix order")
    sources = list(meta.get("sources", []))
    if n and (arrays["sources"].min() < 0 or arrays["sources"].max() >= len(sources)):
        raise DamagedMemory("has a damaged sequence table")
    starts = np.concatenate([[0], ends[:-1] + 1]) if n else np.zeros(0, np.int64)
    columns = (arrays["ids"], starts, lengths, arrays["times"], arrays["sources"], arrays["offsets"])
    sequences = [
        Sequence(int(i), int(s), int(length), float(t), sources[int(k)], int(o))
        for i, s, length, t, k, o in zip(*columns, strict=True)
    ]
    return str(meta.get("generation", "")), index, sequences, set(meta.get("models", []))


def summaries(folder: Path | None = None) -> list[Summary]:
    """Every memory file's summary (a damaged one is left out, and left where it is)."""
    found = []
    for path in sorted((folder or memory_dir()).glob(f"*{SUFFIX}")):
        try:
            _, index, sequences, models = read_file(path)
        except DamagedMemory:
            continue
        by_source: dict[str, tuple[int, int]] = {}
        for s in sequences:
            count, tokens = by_source.get(s.source, (0, 0))
            by_source[s.source] = (count + 1, tokens + s.length)
        times = [s.time for s in sequences]
        found.append(
            Summary(
                path,
                sorted(models),
                sum(s.length for s in sequences),
                len(sequences),
                path.stat().st_size,
                min(times, default=None),
                max(times, default=None),
                by_source,
            )
        )
    return found


def clear_all(folder: Path | None = None) -> int:
    """Remove every memory file (under each one's lock); how many there were."""
    paths = sorted((folder or memory_dir()).glob(f"*{SUFFIX}"))
    for path in paths:
        with locked(f"memory-{path.name[: -len(SUFFIX)]}", None):
            path.unlink(missing_ok=True)
    return len(paths)
