"""IncrementalDetokenizer against tokenizers trained here (no model hub needed)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ferrox.common.errors import UnsupportedModelError
from ferrox.common.sampling_params import SamplingParams
from ferrox.frontend.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer

FFFD = "\ufffd"
WORDS = [
    *["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "hello"],
    *["world", "tokens", "stream", "out", "of", "the", "model", "and", "the", "engine"],
    *["decodes", "bytes", "into", "text", "for", "every", "request"],
]
CJK = "中文字符编码测试你好世界模型推理引擎流式输出"
EMOJI = "😀🚀🎉👍🔥🌍🙂"
ACCENTED = ["café", "naïve", "façade", "Ünïcödé", "señor"]
# Neither is in the training text, so the SentencePiece-style tokenizers fall back to bytes.
RARE_CJK = "齉"
RARE_EMOJI = "🦀"
PROMPTS = ["", "Hello", "The engine said:", "你好 世界", "emoji 🚀 and café", "a b c d e f g"]


def _training_text(num_lines: int = 400) -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(num_lines):
        parts = []
        for _ in range(rng.randint(3, 12)):
            roll = rng.random()
            if roll < 0.5:
                parts.append(rng.choice(WORDS))
            elif roll < 0.7:
                parts.append("".join(rng.choices(CJK, k=rng.randint(1, 4))))
            elif roll < 0.8:
                parts.append(rng.choice(EMOJI))
            elif roll < 0.9:
                parts.append(rng.choice(ACCENTED))
            else:
                parts.append(f"{rng.randint(0, 999)}{rng.choice(',.!?')}")
        lines.append(" ".join(parts))
    return lines


def _byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,  # small, so many CJK characters and emoji span 2-3 tokens
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer)
    return tokenizer


def _sentencepiece_bpe(llama_style: bool) -> Tokenizer:
    """A BPE over "▁"-marked words with byte fallback.

    Metaspace style: Metaspace pre-tokenizer and decoder (drops the first token's "▁").
    Llama style: Prepend/Replace normalizer and a Replace, ByteFallback, Fuse, Strip decoder.
    """
    specials = ["<unk>", "<s>", "</s>"]
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, limit_alphabet=60, show_progress=False
    )
    trainer_tokenizer.train_from_iterator(_training_text(), trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):  # byte-fallback pieces are ordinary vocabulary entries
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(merge) for merge in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    if llama_style:
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]
        )
    tokenizer.add_special_tokens(specials)
    return tokenizer


@pytest.fixture(scope="session")
def byte_level() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=_byte_level_bpe(), eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def metaspace() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_sentencepiece_bpe(llama_style=False),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


@pytest.fixture(scope="session")
def llama_style() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_sentencepiece_bpe(llama_style=True),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def _encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(
    tokenizer: PreTrainedTokenizerFast,
    output_ids: Sequence[int],
    prompt_ids: Sequence[int] = (),
    chunk_sizes: Sequence[int] = (1,),
    **params: object,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feeds ``output_ids`` in chunks, finishes, and returns every get_delta result."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))
    deltas = []
    position = 0
    step = 0
    while position < len(output_ids):
        size = chunk_sizes[step % len(chunk_sizes)]
        detokenizer.update(output_ids[position : position + size])
        deltas.append(detokenizer.get_delta())
        position += size
        step += 1
    detokenizer.finish()
    deltas.append(detokenizer.get_delta())
    return detokenizer, deltas


def _in_context(tokenizer: PreTrainedTokenizerFast, prompt: list[int], output: list[int]) -> str:
    """What ``output`` adds to the text of ``prompt``."""
    before = tokenizer.decode(prompt)
    after = tokenizer.decode(prompt + output)
    assert after.startswith(before)
    return after[len(before) :]


def test_multibyte_character_waits_for_its_last_byte_level_token(byte_level):
    ids = _encode(byte_level, "中文 😀")
    assert len(ids) > len("中文 😀")  # some characters span several tokens
    detokenizer, deltas = _stream(byte_level, ids)
    assert all(FFFD not in delta for delta in deltas)
    assert "".join(deltas) == detokenizer.output_text == "中文 😀"


def test_byte_fallback_character_waits_for_all_its_bytes(metaspace):
    ids = _encode(metaspace, f"a{RARE_CJK}")
    pieces = metaspace.convert_ids_to_tokens(ids)
    assert pieces[-3:] == ["<0xE9>", "<0xBD>", "<0x89>"]
    detokenizer, deltas = _stream(metaspace, ids)
    assert deltas[-4:] == ["", "", RARE_CJK, ""]
    assert detokenizer.output_text == f"a{RARE_CJK}"


def test_byte_level_spacing(byte_level):
    ids = _encode(byte_level, "hello world  the")
    assert byte_level.convert_ids_to_tokens(ids)[-1] == "Ġthe"
    detokenizer, deltas = _stream(byte_level, ids)
    assert "".join(deltas) == detokenizer.output_text == "hello world  the"
    assert deltas[-2:] == [" the", ""]


@pytest.mark.parametrize("fixture", ["metaspace", "llama_style"])
def test_sentencepiece_leading_space(fixture, request):
    tokenizer = request.getfixturevalue(fixture)
    output = _encode(tokenizer, "hello world")
    assert tokenizer.convert_ids_to_tokens(output)[0].startswith("▁")
    # Without a prompt the first "▁" is dropped, as decode() does.
    assert _stream(tokenizer, output)[0].output_text == "hello world"
    # After a prompt the output continues its text, so the space stays.
    prompt = _encode(tokenizer, "say")
    assert _stream(tokenizer, output, prompt)[0].output_text == " hello world"
    # A prompt made only of special tokens adds no text, so the space goes again.
    assert _stream(tokenizer, output, [tokenizer.bos_token_id])[0].output_text == "hello world"


def test_prompt_ending_inside_a_character(byte_level):
    ids = _encode(byte_level, "ok 😀")
    split = len(ids) - 1  # the emoji's bytes straddle the prompt and the output
    assert FFFD in byte_level.decode(ids[:split])
    detokenizer, _ = _stream(byte_level, ids[split:], ids[:split])
    assert detokenizer.output_text == "😀"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(byte_level, skip):
    ids = [byte_level.convert_tokens_to_ids("<|im_start|>"), *_encode(byte_level, "hi")]
    ids += [byte_level.eos_token_id]
    detokenizer, _ = _stream(byte_level, ids, skip_special_tokens=skip)
    expected = "hi" if skip else "<|im_start|>hi<|endoftext|>"
    assert detokenizer.output_text == expected == byte_level.decode(ids, skip_special_tokens=skip)


def test_skipped_special_token_keeps_sentencepiece_spacing(metaspace):
    ids = [*_encode(metaspace, "hello"), metaspace.eos_token_id, *_encode(metaspace, " world")]
    detokenizer, _ = _stream(metaspace, ids)
    assert (
        detokenizer.output_text == "hello world" == metaspace.decode(ids, skip_special_tokens=True)
    )


def test_stop_string_straddling_tokens(byte_level):
    ids = _encode(byte_level, "the quick brown fox jumps")
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["wn fo"]))
    matched = [detokenizer.update([token_id]) for token_id in ids]
    assert [stop for stop in matched if stop] == ["wn fo"]
    assert detokenizer.output_text == "the quick bro"
    assert detokenizer.stop_string == "wn fo" and detokenizer.is_finished
    assert detokenizer.update(_encode(byte_level, " more")) is None  # ignored after a stop
    assert detokenizer.output_text == "the quick bro"


def test_stop_string_in_the_first_tokens(byte_level):
    ids = _encode(byte_level, "hello world")
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["he"]))
    assert detokenizer.update(ids) == "he"
    assert detokenizer.output_text == ""
    assert detokenizer.get_delta() == ""


def test_include_stop_string_cuts_after_it(byte_level):
    ids = _encode(byte_level, "the quick brown fox")
    params = {"stop": ["quick"], "include_stop_str_in_output": True}
    detokenizer, deltas = _stream(byte_level, ids, chunk_sizes=[len(ids)], **params)
    assert detokenizer.output_text == "".join(deltas) == "the quick"


def test_first_stop_string_to_end_wins(byte_level):
    ids = _encode(byte_level, "the quick brown fox")
    detokenizer = IncrementalDetokenizer(
        byte_level, [], SamplingParams(stop=["brown fox", "quick", "ick"])
    )
    assert detokenizer.update(ids) == "quick"  # "quick" and "ick" end together; longer wins
    assert detokenizer.output_text == "the "


def test_stop_string_in_multibyte_text(metaspace):
    text = f"中文{RARE_CJK}{RARE_EMOJI} world"
    detokenizer, deltas = _stream(metaspace, _encode(metaspace, text), stop=[f"{RARE_EMOJI} w"])
    assert detokenizer.output_text == "".join(deltas) == f"中文{RARE_CJK}"


def test_get_delta_holds_back_a_possible_stop_string(byte_level):
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["fox!"]))
    detokenizer.update(_encode(byte_level, "the f"))
    assert detokenizer.get_delta() == "the "
    detokenizer.update(_encode(byte_level, "o"))
    assert detokenizer.get_delta() == ""
    detokenizer.update(_encode(byte_level, "x?"))  # not the stop string after all
    assert detokenizer.get_delta() == "fox?"
    detokenizer.update(_encode(byte_level, " fo"))
    assert detokenizer.get_delta() == " "
    assert detokenizer.finish() is None
    assert detokenizer.get_delta() == "fo"  # released when the sequence ends
    assert detokenizer.output_text == "the fox? fo"


def test_min_tokens_ignores_earlier_stop_strings(byte_level):
    ids = _encode(byte_level, "the fox and the fox")
    detokenizer, deltas = _stream(byte_level, ids, stop=["fox"], min_tokens=4)
    assert detokenizer.output_text == "".join(deltas) == "the fox and the "


@pytest.mark.parametrize("fixture", ["byte_level", "metaspace", "llama_style"])
def test_decode_token_keeps_leading_space(fixture, request):
    tokenizer = request.getfixturevalue(fixture)
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    (the,) = _encode(tokenizer, "a the")[-1:]
    assert tokenizer.convert_ids_to_tokens(the) in ("Ġthe", "▁the")
    assert detokenizer.decode_token(the) == " the"
    assert detokenizer.decode_token(tokenizer.eos_token_id) == tokenizer.eos_token


def test_decode_token_of_a_partial_character(metaspace):
    detokenizer = IncrementalDetokenizer(metaspace, [], SamplingParams())
    assert detokenizer.decode_token(metaspace.convert_tokens_to_ids("<0xE9>")) == FFFD


def test_work_per_update_is_bounded(byte_level):
    calls: list[int] = []

    class CountingTokenizer:
        def __init__(self, inner: Tokenizer) -> None:
            self.inner = inner

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            calls.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    output = _encode(byte_level, " ".join(_training_text(100)))
    detokenizer = IncrementalDetokenizer(byte_level, [], SamplingParams())
    detokenizer._tokenizer = CountingTokenizer(detokenizer._tokenizer)
    for token_id in output:
        detokenizer.update([token_id])
    detokenizer.finish()
    assert len(output) > 1000
    assert len(calls) <= 2 * len(output) + 1
    assert max(calls) <= 8
    assert detokenizer.output_text == byte_level.decode(output)


def test_invalid_bytes_do_not_grow_the_window(byte_level):
    lead_byte = byte_level.convert_tokens_to_ids("ä")  # 0xE4 alone: never completed
    output = [lead_byte] * (3 * MAX_PENDING_TOKENS)
    detokenizer, deltas = _stream(byte_level, output)
    assert len(detokenizer._window) <= MAX_PENDING_TOKENS
    assert detokenizer.output_text == "".join(deltas) == byte_level.decode(output)


def test_rejects_a_tokenizer_without_a_fast_backend():
    with pytest.raises(UnsupportedModelError, match="fast tokenizer"):
        IncrementalDetokenizer(object(), [], SamplingParams())


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    prompt=st.sampled_from(PROMPTS),
    skip=st.booleans(),
    chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_byte_level_final_text_equals_decode(byte_level, data, prompt, skip, chunk_sizes):
    # Any ids, including special tokens and bytes that never form a character: byte-level
    # decoding replaces invalid bytes locally, so streaming can match it exactly.
    vocab_size = len(byte_level)
    output = data.draw(st.lists(st.integers(0, vocab_size - 1), max_size=48))
    prompt_ids = _encode(byte_level, prompt)
    detokenizer, deltas = _stream(
        byte_level, output, prompt_ids, chunk_sizes, skip_special_tokens=skip
    )
    expected = byte_level.decode(output, skip_special_tokens=skip)
    assert detokenizer.output_text == "".join(deltas) == expected


def _valid_byte_runs(tokenizer: PreTrainedTokenizerFast) -> st.SearchStrategy[list[int]]:
    """Token ids whose byte-fallback pieces always spell whole characters.

    The ByteFallback decoder turns a run of byte pieces into one U+FFFD per byte when the
    run as a whole is not UTF-8, valid characters in it included; no decoder that streams
    can know that before the run ends (tokenizers' own DecodeStream raises there), so
    such runs are left out here.
    """
    byte_piece = re.compile(r"<0x[0-9A-F]{2}>")
    vocab = tokenizer.get_vocab()
    plain_ids = sorted(i for piece, i in vocab.items() if not byte_piece.fullmatch(piece))
    byte_ids = {int(piece[3:5], 16): i for piece, i in vocab.items() if byte_piece.fullmatch(piece)}
    as_bytes = st.characters(codec="utf-8").map(
        lambda char: [byte_ids[byte] for byte in char.encode()]
    )
    atoms = st.one_of(st.sampled_from(plain_ids).map(lambda i: [i]), as_bytes)
    return st.lists(atoms, max_size=24).map(lambda lists: [i for ids in lists for i in ids])


@pytest.mark.parametrize("fixture", ["metaspace", "llama_style"])
@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    prompt=st.sampled_from(PROMPTS),
    skip=st.booleans(),
    chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_sentencepiece_final_text_equals_decode(fixture, request, data, prompt, skip, chunk_sizes):
    tokenizer = request.getfixturevalue(fixture)
    output = data.draw(_valid_byte_runs(tokenizer))
    prompt_ids = _encode(tokenizer, prompt)
    detokenizer, deltas = _stream(
        tokenizer, output, prompt_ids, chunk_sizes, skip_special_tokens=skip
    )
    if prompt_ids:
        before = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
        after = tokenizer.decode(prompt_ids + output, skip_special_tokens=skip)
        assert after.startswith(before)
        expected = after[len(before) :]
    else:
        expected = tokenizer.decode(output, skip_special_tokens=skip)
    assert detokenizer.output_text == "".join(deltas) == expected


@settings(max_examples=200, deadline=None)
@given(data=st.data(), include=st.booleans())
def test_stop_string_cuts_at_its_first_occurrence(byte_level, data, include):
    text = data.draw(st.sampled_from(_training_text(20)))
    ids = _encode(byte_level, text)
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : data.draw(st.integers(start + 1, min(len(text), start + 6)))]
    detokenizer, deltas = _stream(byte_level, ids, stop=[stop], include_stop_str_in_output=include)
    first = text.find(stop)
    assert detokenizer.stop_string == stop
    assert detokenizer.output_text == "".join(deltas)
    assert detokenizer.output_text == text[: first + len(stop) if include else first]


def test_smollm2_tokenizer(smollm2_path):
    from ferrox.loader.gguf import load_gguf

    tokenizer = load_gguf(smollm2_path).tokenizer
    text = "Hello, world! 你好 世界 😀 café"
    ids = _encode(tokenizer, text)
    detokenizer, deltas = _stream(tokenizer, ids, _encode(tokenizer, "Say:"))
    assert detokenizer.output_text == "".join(deltas) == tokenizer.decode(ids) == text
