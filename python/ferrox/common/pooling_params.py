"""What an embedding request asks for (vLLM's `PoolingParams`)."""

from __future__ import annotations

from dataclasses import dataclass

from ferrox.common.errors import InvalidArgumentError


@dataclass(kw_only=True)
class PoolingParams:
    """The prompt's embedding: the final hidden state of its last token
    (last-token pooling, as decoder-only embedding models such as
    Qwen3-Embedding are trained), scaled to unit length when `normalize`."""

    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise InvalidArgumentError(
                f"normalize must be a bool, got {type(self.normalize).__name__}"
            )


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs a score request means: one text against
    each of the others, or two lists of the same length, pair by pair."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise InvalidArgumentError("text_1 and text_2 must not be empty")
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise InvalidArgumentError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or "
            "as many as text_2"
        )
    return list(zip(firsts, seconds, strict=True))
