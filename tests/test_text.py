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
