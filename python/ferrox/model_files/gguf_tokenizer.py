"""Building a Hugging Face fast tokenizer from a GGUF file's `tokenizer.*` metadata.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, used by Llama 3, Qwen2/3,
SmolLM, StarCoder, ...) are supported. How text is split before BPE is not stored as a rule in the
file, only as a name (`tokenizer.ggml.pre`); the split rules below are those of the original
`tokenizer.json` files for each name.
"""

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from transformers import PreTrainedTokenizerFast

from ferrox.common.errors import ModelLoadError, UnsupportedModelError

logger = logging.getLogger(__name__)

SpecialToken = tuple[str, int]  # (text, id)

# llama.cpp's token types (`tokenizer.ggml.token_type`)
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-4o, gpt-oss): cased words with their contractions, digits in threes.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_EACH_DIGIT = r"\p{N}"
# `None` stands for the GPT-2 split built into the ByteLevel pre-tokenizer.
_GPT2_SPLIT = None

# tokenizer.ggml.pre -> the splits applied in order, then byte-level encoding
_SPLITS_BY_PRE: dict[str, tuple[str | None, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo"), (_GPT2_SPLIT,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
        (_EACH_DIGIT, _GPT2_SPLIT),
    ),
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"), (_LLAMA3_SPLIT,)
    ),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
    **dict.fromkeys(("gpt-4o",), (_GPT4O_SPLIT,)),
}
# Qwen's own tokenizer.json normalizes to NFC before splitting.
_NFC_PRE = frozenset({"qwen2"})


def build_tokenizer(metadata: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """A fast tokenizer equivalent to the one the GGUF file was converted from."""
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {model_type!r} is not supported; only byte-level BPE ('gpt2')"
        )
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelLoadError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    pre_name = metadata.get("tokenizer.ggml.pre", "default")
    if "tokenizer.ggml.pre" not in metadata:
        logger.warning("GGUF file names no pre-tokenizer; splitting text like GPT-2")

    backend = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=_merges(metadata), fuse_unk=False))
    if pre_name in _NFC_PRE:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer(pre_name)
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, metadata.get("tokenizer.ggml.token_type"))

    bos, eos, unk, pad = (
        _special_token(tokens, metadata, key) for key in ("bos", "eos", "unknown", "padding")
    )
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    backend.post_processor = _post_processor(bos if add_bos else None, eos if add_eos else None)

    architecture = metadata.get("general.architecture", "")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos and bos[0],
        eos_token=eos and eos[0],
        unk_token=unk and unk[0],
        pad_token=pad and pad[0],
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=metadata.get("tokenizer.chat_template"),
        model_max_length=int(metadata.get(f"{architecture}.context_length", 1 << 30)),
        clean_up_tokenization_spaces=False,
    )


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # a repeated token keeps its first id
    return vocab


def _merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for merge in metadata.get("tokenizer.ggml.merges", ()):
        left, separator, right = merge.partition(" ")
        if not separator:
            raise ModelLoadError(f"malformed BPE merge in GGUF file: {merge!r}")
        merges.append((left, right))
    return merges


def _pre_tokenizer(pre_name: str) -> pre_tokenizers.PreTokenizer:
    splits = _SPLITS_BY_PRE.get(pre_name)
    if splits is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre_name!r} is not supported; known: {sorted(_SPLITS_BY_PRE)}"
        )
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        for pattern in splits
        if pattern is not None
    ]
    uses_gpt2_split = _GPT2_SPLIT in splits
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=uses_gpt2_split))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _add_special_tokens(backend: Tokenizer, tokens: list[str], token_types: Any) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so that
    both are matched whole in the input text instead of being split by BPE."""
    if token_types is None:
        return
    if len(token_types) != len(tokens):
        raise ModelLoadError("GGUF token types and tokens differ in length")
    control, user_defined = [], []
    for token, token_type in zip(tokens, token_types, strict=True):
        if token_type == _CONTROL:
            control.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _USER_DEFINED:
            user_defined.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)


def _special_token(tokens: list[str], metadata: Mapping[str, Any], key: str) -> SpecialToken | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ModelLoadError(f"GGUF {key} token id {token_id} is outside the vocabulary")
    return tokens[token_id], int(token_id)


def _post_processor(bos: SpecialToken | None, eos: SpecialToken | None) -> processors.PostProcessor:
    """Adds BOS/EOS around each sequence (`None` for one the file does not ask for)."""

    def wrapped(sequence: str, type_id: int) -> str:
        parts = [
            bos and f"{bos[0]}:{type_id}",
            f"{sequence}:{type_id}",
            eos and f"{eos[0]}:{type_id}",
        ]
        return " ".join(part for part in parts if part)

    return processors.TemplateProcessing(
        single=wrapped("$A", 0),
        pair=f"{wrapped('$A', 0)} {wrapped('$B', 1)}",
        special_tokens=[token for token in (bos, eos) if token is not None],
    )
