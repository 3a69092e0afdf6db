"""Grammars: llama.cpp's GBNF engine telling which tokens may come next.

A grammar constrains an answer (JSON under a schema, or any GBNF text). At every position
the target's law becomes p_g ∝ p·1[allowed] (sampling.constrained), and speculation stays
exact because verification uses p_g row by row, the grammar walked along the draft only
as far as it is accepted (engine.py), and a draft model's q is masked the same way. The
grammar drafts too: where it allows one continuation only (a schema's keys, JSON
punctuation), that text is a free draft (drafters.GrammarDrafter).

JSON schemas become grammars by llama-cpp-python's converter, with the separators of
`json.dumps` (", " and ": ") and no other whitespace: one way to write each answer, so
the punctuation and keys around the values are forced, and drafted for free.

Grammars are untrusted input (a client's request). GBNF text is bounded in size and
nesting before llama.cpp's recursive parser reads it; a JSON schema is converted in the
sandbox worker (sandbox.py); and a grammar whose state grows with each token (an
ambiguous one: llama.cpp keeps every parse) is stopped once one step takes STEP_SECONDS.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import tempfile
from contextlib import contextmanager
from time import perf_counter

import llama_cpp
import numpy as np

from .errors import EdgespecError
from .sampling import Law, SamplingParams, constrained_argmax, constrained_law
from .sandbox import sandbox

MAX_GRAMMAR_CHARS = 64 << 10  # GBNF text (given, or made from a schema) longer than this is refused
MAX_SCHEMA_CHARS = 64 << 10
MAX_NESTING = 64  # deepest ( ... ) nesting: llama.cpp's parser recurses once per level
SCHEMA_SECONDS = 2.0  # a schema whose conversion takes longer is refused
STEP_SECONDS = 1.0  # a grammar step (accepting a token, or checking candidates) slower than this stops the answer
# a step slower than this means the grammar's state is growing: tokens are then taken in a
# byte at a time, so that one long token cannot multiply the state many times over in one call
CAREFUL_SECONDS = 0.01
MAX_FORCED_CHARS = 64  # longest forced text drafted at once
# every printable ASCII character, and the whitespace a grammar may force: a forced
# continuation is found character by character by asking which of these may come next
PROBE_CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data
# json.dumps's separators in place of the converter's optional spaces (see _compact)
SEPARATORS = ((re.compile(r'"," space\b'), '", "'), (re.compile(r'":" space\b'), '": "'))
SPACE_RULE = re.compile(r"^space ::= .*$", re.MULTILINE)
# the converter's string characters include control characters, which JSON strings may not hold raw
CHAR_RULE = ('char ::= [^"\\\\]', 'char ::= [^"\\\\\\x7F\\x00-\\x1F]')  # (the converter's, JSON's)
FIX_GBNF = "fix it (GBNF as llama.cpp's grammars/README.md describes)"
FIX_SCHEMA = "fix the schema (JSON Schema as llama.cpp's json_schema_to_grammar supports)"
CONVERTER = importlib.util.find_spec("llama_cpp.llama_grammar").origin
COMPOSED = {"anyOf", "oneOf", "allOf", "enum", "const", "$ref"}  # a list of types beside these is left as it is
VALUES = {"enum", "const", "default", "examples"}  # keywords whose values are JSON data, not schemas


class GrammarError(EdgespecError):
    """A grammar that cannot be used, or that stopped working during an answer."""


def check_gbnf(gbnf: str) -> None:
    """Refuse GBNF text that is too large, or nested deeper than llama.cpp's parser may recurse."""
    if not isinstance(gbnf, str) or not gbnf.strip():
        raise GrammarError("the grammar is empty; give GBNF text with a root rule")
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar has {len(gbnf)} characters, more than {MAX_GRAMMAR_CHARS}; simplify it")
    if (depth := nesting(gbnf)) > MAX_NESTING:
        raise GrammarError(f"the grammar nests groups {depth} deep, more than {MAX_NESTING}; flatten it into rules")


def nesting(gbnf: str) -> int:
    """The deepest ( ... ) nesting of GBNF text, outside literals, character classes and comments."""
    depth = deepest = 0
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c == "#":
            while i < n and gbnf[i] != "\n":
                i += 1
        elif c in '"[':
            end = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != end:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def json_schema_gbnf(schema: dict | str, name: str = "") -> str:
    """The GBNF grammar of a JSON schema (a dict or its JSON text), in json.dumps's style;
    its top rule is `name` (default: root)."""
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"the JSON schema has {len(schema)} characters, more than {MAX_SCHEMA_CHARS}")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not JSON ({e}); {FIX_SCHEMA}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema is an object, not {type(schema).__name__}; {FIX_SCHEMA}")
    if len(text := json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"the JSON schema has {len(text)} characters, more than {MAX_SCHEMA_CHARS}")
    schema = _one_type_each(schema)
    request = dict(kind="json_schema", converter=CONVERTER, schema=schema, name=name, max_chars=MAX_GRAMMAR_CHARS)
    what = "converting the JSON schema"
    answer = sandbox.answer(request, SCHEMA_SECONDS, what=what, fix=FIX_SCHEMA, error=GrammarError)
    if "too_long" in answer:
        raise GrammarError(f"the JSON schema makes a grammar of {answer['too_long']} characters; simplify it")
    return _compact(answer["gbnf"])


def _one_type_each(schema):
    """The schema with each list of types ({"type": ["string", "null"], "maxLength": 30}) written as
    a choice of one type each ({"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]}):
    the converter reads a list of types as bare types and drops their limits (maxLength, items,
    properties), so answers it allowed broke the schema. Keywords of other types are ignored by
    validators, so every choice keeps them all."""
    if isinstance(schema, list):
        return [_one_type_each(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: value if key in VALUES else _one_type_each(value) for key, value in schema.items()}
    types = schema.get("type")
    if isinstance(types, list) and not COMPOSED & schema.keys():
        rest = {key: value for key, value in schema.items() if key != "type"}
        return {"anyOf": [{"type": kind, **rest} for kind in types]}
    return schema


def grammar_text(grammar: str | None, json_schema: dict | str | None) -> str | None:
    """The GBNF text of what a request constrains its answer to (None: nothing)."""
    if grammar is not None and json_schema is not None:
        raise GrammarError("give a grammar or a JSON schema, not both")
    return json_schema_gbnf(json_schema) if json_schema is not None else grammar


def _compact(gbnf: str) -> str:
    """The converter's grammar with ", " and ": " as separators, no other whitespace, and
    no raw control characters in strings."""
    for pattern, separator in SEPARATORS:
        gbnf = pattern.sub(separator, gbnf)
    gbnf = gbnf.replace(*CHAR_RULE)
    return SPACE_RULE.sub('space ::= ""', gbnf)


@contextmanager
def _stderr_captured():
    """llama.cpp's grammar parser prints its errors to stderr: catch them (to say them in one line)."""
    with tempfile.TemporaryFile(mode="w+b") as capture:
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        lines: list[str] = []
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines.extend(capture.read(4096).decode("utf-8", "replace").splitlines())


_byte_tokens: dict[str, dict[int, int]] = {}


def byte_tokens(model) -> dict[int, int]:
    """byte -> a token that is that byte alone, for the bytes the vocabulary has one for
    (found once per model file: 0.2 s for Qwen2.5's 151k tokens)."""
    key = str(model.path)
    if key not in _byte_tokens:
        found: dict[int, int] = {}
        for token in range(model.n_vocab):
            piece = model.piece(token)
            if len(piece) == 1 and not model.is_eog(token):
                found.setdefault(piece[0], token)
        _byte_tokens[key] = found
    return _byte_tokens[key]


class Grammar:
    """One grammar's state over a model's vocabulary: which tokens may come next,
    advanced token by token. clone() copies the state (to walk ahead along a draft)."""

    def __init__(self, model, gbnf: str) -> None:
        """model: whose vocabulary the tokens are (the target). gbnf: the grammar's text, root rule `root`."""
        self._sampler = None
        check_gbnf(gbnf)
        with _stderr_captured() as messages:
            sampler = llama_cpp.llama_sampler_init_grammar(model.vocab_handle, gbnf.encode(), b"root")
        if not sampler:
            why = next((m.split("error parsing grammar: ")[-1] for m in messages if "error parsing" in m), None)
            why = why or "an undefined rule, left recursion or no root rule"
            raise GrammarError(f"the grammar does not parse ({why}); {FIX_GBNF}")
        self._sampler = sampler
        self.careful = False  # see CAREFUL_SECONDS
        self.model = model
        self.eog = model.eos
        # single-character tokens, to find a forced continuation one character at a time
        singles = byte_tokens(model)
        self.probes = {singles[ord(c)]: c for c in PROBE_CHARS if ord(c) in singles}
        self._probe_ids = np.array(list(self.probes), dtype=np.int32)
        if not self.allows(np.array([self.eog], dtype=np.int32))[0] and not self.allows(self._probe_ids).any():
            if not self.allows(np.arange(model.n_vocab, dtype=np.int32)).any():  # not even a non-ASCII one
                raise GrammarError(f"no output can satisfy the grammar (it allows no first token); {FIX_GBNF}")

    done = False  # (a grammar constrains an answer to its end)

    def law(self, logits: np.ndarray, params: SamplingParams, vocab=None) -> Law:
        """p_g: the law after the request's filters, less what the grammar forbids (sampling.constrained_law)."""
        return constrained_law(logits, params, self.allows, vocab)

    def argmax(self, logits: np.ndarray) -> int:
        return constrained_argmax(logits, self.allows)

    def clone(self) -> Grammar:
        other = object.__new__(Grammar)
        other.__dict__.update(self.__dict__)
        other._sampler = llama_cpp.llama_sampler_clone(self._sampler)
        return other

    def allows(self, ids: np.ndarray) -> np.ndarray:
        """Which of these token ids the grammar lets come next (an end of generation only
        where the grammar may end)."""
        data = np.zeros(len(ids), dtype=TOKEN_DATA)
        data["id"] = ids
        pointer = data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
        array = llama_cpp.llama_token_data_array(data=pointer, size=len(data), selected=-1, sorted=False)
        start = perf_counter()
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        self._check_time(perf_counter() - start)
        return data["logit"] != -np.inf

    def accept(self, token: int) -> None:
        """Advance past `token`, which must be allowed (an end of generation is not taken in)."""
        if token == self.eog:
            return
        pieces = [token]
        if self.careful:  # the same state as the whole token (llama.cpp reads it byte by byte too)
            bytes_ = byte_tokens(self.model)
            piece = self.model.piece(token)
            if all(b in bytes_ for b in piece):
                pieces = [bytes_[b] for b in piece]
        for piece_token in pieces:
            start = perf_counter()
            llama_cpp.llama_sampler_accept(self._sampler, piece_token)
            self._check_time(perf_counter() - start)

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` that the grammar allows, one after another."""
        walk = self.clone()
        for n, token in enumerate(tokens):
            if not walk.allows(np.array([token], dtype=np.int32))[0]:
                return tokens[:n]
            walk.accept(token)
        return tokens

    def forced_text(self, max_chars: int = MAX_FORCED_CHARS) -> str:
        """The text the grammar allows as the only continuation from here (maybe ""): grown
        while exactly one character may come next and the answer may not end there."""
        walk, text = self.clone(), []
        eog = np.array([self.eog], dtype=np.int32)
        while len(text) < max_chars and not walk.allows(eog)[0]:
            allowed = self._probe_ids[walk.allows(self._probe_ids)]
            if len(allowed) != 1:
                break
            token = int(allowed[0])
            text.append(self.probes[token])
            walk.accept(token)
        return "".join(text)

    def finished(self) -> bool:
        """Whether nothing but an end of generation may come next."""
        if not self.allows(np.array([self.eog], dtype=np.int32))[0] or self.allows(self._probe_ids).any():
            return False  # the cheap answers first: most of the time one of them is no
        allowed = np.flatnonzero(self.allows(np.arange(self.model.n_vocab, dtype=np.int32)))
        return all(self.model.is_eog(int(token)) for token in allowed)

    def _check_time(self, seconds: float) -> None:
        self.careful = self.careful or seconds > CAREFUL_SECONDS
        if seconds > STEP_SECONDS:
            raise GrammarError(
                f"the grammar's state grew too large (one step took {seconds:.1f} s: an ambiguous grammar); simplify it"
            )

    def close(self) -> None:
        if self._sampler:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        self.close()
