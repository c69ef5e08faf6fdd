"""What an embedding request asks for (vLLM's `PoolingParams`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ferrox.common.errors import InvalidArgumentError


@dataclass(kw_only=True)
class PoolingParams:
    """What a pooling request returns, from the final hidden state of its
    prompt's last token (last-token pooling, as decoder-only embedding
    models such as Qwen3-Embedding and sequence classifiers are trained):

    - task "embed": that state (its first `dimensions` values, for a
      Matryoshka-trained model), scaled to unit length when `normalize`;
    - task "classify" (a model with a sequence-classification head): the
      head's output, as probabilities when `activation` (a sigmoid for one
      label, a softmax over several), else as logits.

    `LLM.embed`, `LLM.classify` and `LLM.score` set the task."""

    task: Literal["embed", "classify"] = "embed"
    normalize: bool = True
    activation: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.task not in ("embed", "classify"):
            raise InvalidArgumentError(f"task must be 'embed' or 'classify', got {self.task!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise InvalidArgumentError(f"dimensions must be an int >= 1, got {self.dimensions!r}")
        for name in ("normalize", "activation"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"{name} must be a bool, got {type(getattr(self, name)).__name__}"
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


def cosine(x: Any, y: Any) -> float:
    """The cosine similarity of two vectors (numpy arrays or lists)."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))
