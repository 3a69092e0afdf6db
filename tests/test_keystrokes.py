"""An editor's keystrokes without a model: which anchor a request is laid out on (the heads read
before, while they are cached), the idle work an answer leaves, and the next keystroke's
prediction from the last suggestion."""

from __future__ import annotations

from test_fim import CHARS, chars

from edgespec.fim import Budgets, FimTokens, Infill, middle
from edgespec.keystrokes import Keystrokes
from edgespec.request import Request
from edgespec.sampling import SamplingParams

FIM = FimTokens(prefix=-1, suffix=-2, middle=-3)
PREFIX = "".join(f"line {i}\n" for i in range(40))
SUFFIX = "\nprint(done)\n"


def keystrokes() -> Keystrokes:
    return Keystrokes(FIM, CHARS, 4096, None)


def held(tokens) -> int:
    """Every head is cached."""
    return len(tokens)


def gone(tokens) -> int:
    """No head is cached."""
    return 0


def test_a_keystroke_and_enter_keep_the_head_read_before():
    k = keystrokes()
    first = k.prompt(Infill(PREFIX, SUFFIX, "x = 1"), held)
    assert first.anchor == len(PREFIX) and first.middle == chars("x = 1")
    typed = k.prompt(Infill(PREFIX, SUFFIX, "x = 12"), held)
    enter = k.prompt(Infill(PREFIX + "x = 12\n", SUFFIX, "y"), held)
    assert typed.head is first.head and typed.middle == chars("x = 12")
    assert enter.head is first.head and enter.anchor == len(PREFIX) and enter.middle == chars("x = 12\ny")


def test_an_editor_window_that_slid_down_a_line_still_fits_the_head():
    k = keystrokes()
    first = k.prompt(Infill(PREFIX, SUFFIX, "x = 1"), held)
    slid = PREFIX[PREFIX.index("\n") + 1 :] + "x = 1\n"  # the window's first line is gone, the typed one came
    enter = k.prompt(Infill(slid, SUFFIX, ""), held)
    assert enter.head is first.head and enter.middle == chars("x = 1\n")


def test_a_head_not_cached_or_of_another_place_is_not_used():
    k = keystrokes()
    first = k.prompt(Infill(PREFIX, SUFFIX, "x = 1"), held)
    for infill, cached in (
        (Infill(PREFIX + "x = 1\n", SUFFIX, ""), gone),  # no longer cached
        (Infill(PREFIX + "x = 1\n", SUFFIX + "more\n", ""), held),  # another suffix
        (Infill(PREFIX.replace("line 7", "line 70") + "x = 1\n", SUFFIX, ""), held),  # an edit above
    ):
        fresh = k.prompt(infill, cached)
        assert fresh.head is not first.head and fresh.anchor == len(infill.prefix) and fresh.middle == []


def test_an_answer_plans_the_accepted_suggestion_and_the_head_at_the_cursor_line():
    k = keystrokes()
    first = k.prompt(Infill(PREFIX, SUFFIX, "x = 1"), held)
    infill = Infill(PREFIX + "x = 1\n", SUFFIX, "y")
    enter = k.prompt(infill, held)
    request = Request(infill, SamplingParams(temperature=0), max_tokens=16, prediction="ignored")
    k.answered(request, enter, " = 2\n")
    read, accept = k.next_idle(), k.next_idle()
    assert k.next_idle() is None
    assert accept.layout is None and accept.request.prompt == Infill(PREFIX + "x = 1\ny = 2\n", SUFFIX, "")
    assert accept.request.max_tokens == 16 and accept.request.prediction is None
    assert read.request.max_tokens == 0 and read.layout.middle == [] and read.layout.anchor == len(infill.prefix)
    # the new head holds the old one's lines and the line typed since: the two share their tokens
    new_head, old_head = list(read.layout.head.tokens), list(first.head.tokens)
    shared = old_head.index(-2)  # up to the old head's [SUF]
    assert new_head[:shared] == old_head[:shared] and read.layout.head.prefix_text == PREFIX + "x = 1\n"
    # a keystroke before it is read plans it again: the same head, remembered once, the old one kept
    typed_on = Infill(infill.prefix, SUFFIX, "y =")
    first_only = lambda tokens: len(tokens) if tokens == first.head.tokens else 0  # noqa: E731
    k.answered(Request(typed_on, max_tokens=16), k.prompt(typed_on, first_only), " 3\n")
    again = k.next_idle()
    assert again.layout.head == read.layout.head and len(k.heads) == 2 and first.head in k.heads
    # once read (cached), the next keystroke is anchored at its line
    after = k.prompt(Infill(PREFIX + "x = 1\n", SUFFIX, "y "), held)
    assert after.head == read.layout.head and after.middle == chars("y ")


def test_a_head_after_a_line_change_keeps_its_prefix_until_over_by_half_the_middle_then_is_cut_lower():
    """Line after line in a long file: each new head holds the last one's prefix and the line typed
    (the two share their tokens) while that fits the prefix's budget and half the middle's; then it is
    cut to the budget less half the middle's, once, and grows again. The middle gets what the prefix
    leaves of the two, so a prompt is never longer than the budgets allow."""
    budgets, k = Budgets.of(4096), keystrokes()
    before = "".join(f"line {i:04}\n" for i in range(200))  # 2000 tokens, one a character
    last = k.prompt(Infill(before, SUFFIX, ""), held).head
    assert last.prefix_length <= budgets.prefix
    kept, cut = 0, 0
    for i in range(30):
        before += f"x = {i:04}\n"  # typed, then Enter
        infill = Infill(before, SUFFIX, "")
        k.answered(Request(infill, max_tokens=16), k.prompt(infill, held), "y\n")
        new = k.next_idle().layout.head
        assert new.prefix_length <= budgets.longest_prefix
        if new.prefix_text == last.prefix_text + f"x = {i:04}\n":
            end = last.tokens.index(-2)  # the old head's [SUF]: all before it is shared
            assert new.tokens[:end] == last.tokens[:end]
            kept += 1
        else:
            assert new.prefix_length <= budgets.prefix - budgets.middle // 2 and before.endswith(new.prefix_text)
            cut += 1
        last = new
    assert kept == 29 and cut == 1
    room = budgets.middle - (budgets.longest_prefix - budgets.prefix)
    for typed, fits in (("z" * room, True), ("z" * (room + 1), False)):
        assert (
            middle(Infill("", SUFFIX, typed), 0, CHARS, n_ctx=4096, prefix=budgets.longest_prefix) is not None
        ) == fits


def test_an_answer_anchored_at_its_cursor_line_plans_no_head_and_later_answers_nothing():
    k = keystrokes()
    infill = Infill(PREFIX, SUFFIX, "x")
    prompt = k.prompt(infill, held)
    request = Request(infill, SamplingParams(temperature=0), max_tokens=16)
    k.answered(request, prompt, " = 1")
    k.answered(request, prompt, " = 2")  # n_cmpl's second answer: a suggestion, no new plan
    assert [w.request.prompt for w in k.idle] == [Infill(PREFIX, SUFFIX, "x = 1")]


def test_the_next_keystroke_is_predicted_from_the_last_suggestion():
    k = keystrokes()
    infill = Infill(PREFIX, SUFFIX, "    return sel")
    k.answered(Request(infill, max_tokens=16), k.prompt(infill, held), "f.x + 1\n")
    assert k.prediction(Infill(PREFIX, SUFFIX, "    return self")) == ".x + 1\n"  # typed as suggested
    assert k.prediction(Infill(PREFIX, SUFFIX, "    return se")) == "lf.x + 1\n"  # a character taken back
    assert k.prediction(Infill(PREFIX, SUFFIX, "    return sex")) == ""  # typed otherwise
    assert k.prediction(Infill(PREFIX, SUFFIX + "x", "    return self")) == ""  # another place
    assert k.prediction(Infill(PREFIX, SUFFIX, "    return self.x + 1\n")) == ""  # all of it typed
