"""request.py's bound on tokenising a prompt: a text far past the context is refused after
encoding a prefix, never encoded whole (issue 26)."""

from __future__ import annotations

import pytest

from decodekit.request import PREFIX_CHARS_PER_TOKEN, encode_text


class CountingEncoder:
    """One token per `width` characters; records how many characters it was asked to encode."""

    def __init__(self, width: int = 4):
        self.width, self.encoded = width, []

    def __call__(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return [0] * -(-len(text) // self.width)


def test_a_text_far_past_the_context_is_refused_from_a_prefix():
    encode = CountingEncoder()
    with pytest.raises(ValueError, match="longer than the model's context of 512 tokens"):
        encode_text(encode, "word " * 1_400_000, 512)  # 7 MB
    assert encode.encoded == [PREFIX_CHARS_PER_TOKEN * 512]


def test_a_text_within_the_bound_is_encoded_whole_once():
    encode = CountingEncoder()
    text = "x" * (PREFIX_CHARS_PER_TOKEN * 512)
    assert len(encode_text(encode, text, 512)) == len(text) // 4
    assert encode.encoded == [len(text)]


def test_a_text_that_tokenises_short_is_not_refused():
    """Many characters a token (collapsed spaces): the prefix grows fourfold, then the whole text
    is encoded and its true length decides (here it fits)."""
    encode = CountingEncoder(width=1000)
    text = " " * 100_000
    assert len(encode_text(encode, text, 512)) == 100
    assert encode.encoded == [8192, 32768, 100_000]
