"""Streaming-safe text: split characters and split stop strings."""

from edgespec.text import TextStream


def test_multibyte_character_split_across_tokens():
    stream = TextStream()
    data = "naïve 🙂".encode()
    pieces = [data[:3], data[3:4], data[4:8], data[8:10], data[10:]]  # cuts inside ï and 🙂
    shown = [stream.push(p) for p in pieces]
    assert "".join(shown) + stream.flush() == "naïve 🙂"
    assert all("\ufffd" not in s for s in shown)


def test_incomplete_character_at_end_is_replaced_not_dropped():
    stream = TextStream()
    assert stream.push("é".encode()[:1]) == ""
    assert stream.flush() == "\ufffd"


def test_stop_string_split_across_tokens_is_trimmed():
    stream = TextStream(stop=["###"])
    assert stream.push(b"answer #") == "answer "  # '#' held back: it may start the stop string
    assert stream.push(b"#") == ""
    assert stream.push(b"# trailing") == ""
    assert stream.stopped and stream.flush() == ""


def test_held_back_text_is_released_when_it_cannot_stop():
    stream = TextStream(stop=["</end>"])
    assert stream.push(b"a </e") == "a "
    assert stream.push(b"x") == "</ex"
    assert not stream.stopped


def test_a_line_indented_less_than_min_indent_ends_the_text_before_it():
    stream = TextStream(min_indent=4)
    assert stream.push(b"x = 1") == "x = 1"  # the first line is the cursor line's rest: never cut
    assert stream.push(b"\n   ") == ""  # held: the next character says whether the line stays
    assert stream.push(b" y = 2\n") == "\n    y = 2"
    assert not stream.under_indented
    assert stream.push(b"  z") == "\n"
    assert stream.under_indented and stream.ended and stream.flush() == ""


def test_a_blank_line_or_tab_indent_counts_as_an_indentation():
    tabs = TextStream(min_indent=1)
    assert tabs.push(b"a\n\tb") == "a\n\tb" and not tabs.under_indented
    blank = TextStream(min_indent=1)
    assert blank.push(b"a\n\nb") == "a\n" and blank.under_indented
