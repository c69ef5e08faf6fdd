"""GGUF files name their pre-tokenizer (`tokenizer.ggml.pre`); ferrox
splits text as the original tokenizer did before byte-level BPE."""

from __future__ import annotations

import pytest

from ferrox.common.errors import UnsupportedModelError
from ferrox.model_files.gguf_tokenizer import _pre_tokenizer


def split(pre: str, text: str) -> list[str]:
    pieces = _pre_tokenizer(pre).pre_tokenize_str(text)
    # (byte-level encoding shows a space as "Ġ")
    return [piece.replace("\u0120", " ") for piece, _ in pieces]


def test_gpt_4o_splits_cased_words_contractions_and_digits_in_threes() -> None:
    """o200k (gpt-oss's GGUF files say "gpt-4o"): an upper-case run joins the
    lower-case letters after it, contractions stay on their word, numbers
    split in threes with their space apart."""
    assert split("gpt-4o", "Hello world's HTTPServer 12345 DON'T") == [
        "Hello", " world's", " HTTPServer", " ", "123", "45", " DON'T",
    ]  # fmt: skip
    # The Llama 3 split keeps contractions apart.
    assert split("llama-bpe", "world's") == ["world", "'s"]


def test_an_unknown_pre_tokenizer_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match="'nonesuch'"):
        _pre_tokenizer("nonesuch")
