"""Fill-in-the-middle without a model: the prompt's layout and budgets (llama-server's), the
infill sampler (llama.cpp's), and /infill and /completion bodies read into requests."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.bench import editors
from edgespec.fim import Chunk, FimTokens, Infill, layout
from edgespec.request import RequestError
from edgespec.sampling import SamplingParams, distribution, infill
from edgespec.server.llama_api import answers_of, request_of

FIM = FimTokens(prefix=-1, suffix=-2, middle=-3, repo=-4, file_sep=-5)


def chars(text: str) -> list[int]:
    """A tokenizer of one token per character."""
    return [ord(c) for c in text]


class Chars:
    """A vocabulary of one token per character."""

    def text_tokens(self, text: str) -> list[int]:
        return chars(text)

    def piece(self, token: int) -> bytes:
        return chr(token).encode()


CHARS = Chars()


def test_the_cursor_line_comes_after_the_middle_token():
    case = Infill("abc", "xyz", "d", [Chunk("CH", "f.py"), Chunk("ck")])
    prompt = layout(case, FIM, CHARS, n_ctx=8192, bos=1)
    head = [-4, *chars("myproject\n"), -5, *chars("f.py\n"), *chars("CH"), -5, *chars("tmp\n"), *chars("ck")]
    head += [-5, *chars("filename\n"), 1, -1, *chars("abc"), -2, *chars("xyz"), -3]
    assert list(prompt.head.tokens) == head and prompt.middle == chars("d") and prompt.tokens == head + chars("d")
    assert prompt.anchor == 3 and prompt.head.prefix_text == "abc"


def test_layout_without_repo_or_file_tokens_separates_snippets():
    case = Infill("p", "s", chunks=[Chunk("one"), Chunk("two")])
    tokens = layout(case, FimTokens(-1, -2, -3), CHARS, n_ctx=8192).tokens
    snippet = chars("\n\n--- snippet ---\n\n")
    assert tokens == [*snippet, *chars("one"), *snippet, *chars("two"), -1, *chars("p"), -2, *chars("s"), -3]


def test_layout_budgets_keep_what_is_nearest_the_cursor():
    """Batch 2048 (llama-server's): the prefix's last 1536 tokens, the suffix's first 510 whatever
    the cursor line, the middle's 256 at most, the chunks' last n_ctx - (batch + 2) - 256 - 256."""
    case = Infill("P" * 2000 + "p", "s" + "S" * 2000, "cur", [Chunk("C" * 5000 + "c")])
    prompt = layout(case, FIM, CHARS, n_ctx=4096)
    tokens = list(prompt.head.tokens)
    pre, suf, mid = tokens.index(-1), tokens.index(-2), tokens.index(-3)
    extra = [-4, *chars("myproject\n"), -5, *chars("tmp\n"), *chars("C" * 5000 + "c"), -5, *chars("filename\n")]
    assert tokens[:pre] == extra[-(4096 - 2050 - 256 - 256) :]
    assert tokens[pre + 1 : suf] == chars("P" * 1535 + "p")
    assert tokens[suf + 1 : mid] == chars(("s" + "S" * 2000)[:510])
    assert mid == len(tokens) - 1 and prompt.middle == chars("cur")


def test_a_keystroke_changes_the_middle_only():
    before, after = (
        layout(Infill("def f(self):\n", "\n", line), FIM, CHARS, n_ctx=4096) for line in ("    sel", "    self")
    )
    assert before.head == after.head and after.middle == before.middle + chars("f")


def test_a_cursor_line_longer_than_the_middle_budget_moves_the_anchor_into_it():
    case = Infill("x\n", "\n", "y" * 300)
    prompt = layout(case, FIM, CHARS, n_ctx=4096)
    assert len(prompt.middle) <= 256 and prompt.anchor > len(case.prefix)
    assert prompt.head.prefix_text + bytes(prompt.middle).decode() == case.before


def test_a_small_context_halves_the_batch_the_budgets_come_from():
    case = Infill("P" * 1000, "S" * 1000, chunks=[Chunk("C" * 1000)])
    tokens = layout(case, FIM, CHARS, n_ctx=1024).tokens
    assert tokens.count(ord("P")) == 3 * 128 and tokens.count(ord("S")) == 128 - 2
    assert len(tokens) < 1024


def test_a_prompt_and_suffix_split_at_the_cursor_line():
    assert Infill.at_cursor("a\nb\n    re", "x") == Infill("a\nb\n", "x", "    re")
    assert Infill.at_cursor("    re", "x") == Infill("", "x", "    re")
    assert Infill.at_cursor("a\n", "x") == Infill("a\n", "x", "")


def test_infill_fields_must_be_text():
    with pytest.raises(Exception, match="must be text"):
        Infill("a", None)  # type: ignore[arg-type]


class Vocab:
    """Tokens' text, end-of-generation tokens and the end-of-turn token, as Model has them."""

    def __init__(self, pieces: dict[int, bytes], eog: set[int], eot: int) -> None:
        self.pieces, self.eog, self.eot = pieces, eog, eot

    def piece(self, token: int) -> bytes:
        return self.pieces.get(token, b"")

    def is_eog(self, token: int) -> bool:
        return token in self.eog


def survivors(weights: dict[int, float], vocab: Vocab) -> dict[int, float]:
    ids, w = infill(np.array(list(weights)), np.array(list(weights.values())), vocab)
    return dict(zip(ids.tolist(), w.tolist(), strict=True))


def test_infill_ends_the_middle_where_end_of_generation_is_likely_enough():
    vocab = Vocab({0: b"a", 1: b"b"}, eog={9}, eot=9)
    # 3 * p_eog * n > p_text: 3 * 0.05 * 3 < 0.95, 3 * 0.3 * 3 > 0.7
    assert set(survivors({0: 0.475, 1: 0.475, 9: 0.05}, vocab)) == {0, 1, 9}
    assert survivors({0: 0.35, 1: 0.35, 9: 0.3}, vocab) == {9: 0.3}


def test_infill_merges_a_prefix_into_the_likelier_and_drops_the_unlikely():
    vocab = Vocab({0: b" foo", 1: b" foobar", 2: b"x", 3: b"yz"}, eog={4}, eot=9)
    # " foo" takes " foobar"'s 0.25 (0.6); "x" (0.25) passes the 0.2 cut but not 1/(2+1) after it
    kept = survivors({0: 0.35, 1: 0.25, 2: 0.25, 3: 0.1, 4: 0.05}, vocab)
    assert kept == {0: 0.35, 4: 0.05}  # llama.cpp then draws in proportion to their own probabilities
    logits = np.log([0.35, 0.25, 0.25, 0.1, 0.05])
    p = distribution(logits, SamplingParams(1.0, top_k=0, top_p=1.0, min_p=0.0, infill=True), vocab)
    assert np.allclose(p, [0.875, 0, 0, 0, 0.125])


def test_infill_with_no_sure_text_token_is_the_end_of_turn_alone():
    vocab = Vocab({i: bytes([65 + i]) for i in range(10)}, eog={10}, eot=11)
    assert survivors({**{i: 0.099 for i in range(10)}, 10: 0.01}, vocab) == {11: 1.0}


LLAMA_VSCODE = editors.LLAMA_VSCODE | {  # llama.vscode's defaults, with its text at a cursor
    "id_slot": 0,
    "input_prefix": "def f():\n",
    "input_suffix": "\n",
    "input_extra": [{"text": "x = 1\n", "time": 1, "filename": "a.py"}],
    "prompt": "    re",
    "n_indent": 4,
    "lora": [],
    "model": "any",
}


def test_llama_vscode_body_reads_as_a_request():
    request = request_of(LLAMA_VSCODE, infill=True)
    assert request.prompt == Infill("def f():\n", "\n", "    re", [Chunk("x = 1\n", "a.py")])
    assert (request.max_tokens, request.min_indent, request.line_deadline_s) == (128, 4, 0.5)
    s = request.sampling
    # only the named filters run; no "temperature": the law at temperature 1, as in llama.cpp's chain
    assert (s.top_k, s.top_p, s.min_p, s.temperature, s.infill) == (40, 0.99, 0.0, 1.0, True)
    assert answers_of(LLAMA_VSCODE) == 3


def test_completion_body_and_sampler_letters():
    request = request_of({"prompt": "<|fim_prefix|>a", "n_predict": -1, "samplers": "kt", "seed": -1}, infill=False)
    assert request.raw and request.max_tokens is None and request.sampling.seed is None
    assert (request.sampling.top_k, request.sampling.top_p, request.sampling.infill) == (40, 1.0, False)
    assert request_of({"prompt": ["x"], "n_predict": 0}, infill=False).max_tokens == 0


@pytest.mark.parametrize(
    "change, param",
    [
        ({"n_cmpl": 7}, "n_cmpl"),
        ({"input_prefix": None}, "input_prefix"),
        ({"input_suffix": 3}, "input_suffix"),
        ({"input_extra": "text"}, "input_extra"),
        ({"input_extra": [{"filename": "a.py"}]}, "input_extra[0]"),
        ({"prompt": 5}, "prompt"),
        ({"samplers": ["top_k", "mirostat"]}, "samplers"),
        ({"n_indent": -1}, "n_indent"),
        ({"n_predict": -2}, "n_predict"),
        ({"t_max_predict_ms": "soon"}, "t_max_predict_ms"),
        ({"stop": [1]}, "stop"),
    ],
)
def test_bad_infill_fields_name_the_field(change, param):
    body = {k: v for k, v in (LLAMA_VSCODE | change).items() if v is not None}
    with pytest.raises(RequestError) as refused:
        request_of(body, infill=True)
        answers_of(body)
    assert refused.value.param == param
