"""Images in a prompt, as the frontend hands them to the engine (no torch).

A processed image is the model's own image processor's output (its pixel
rows and patch grid) plus where its placeholder tokens sit in the prompt.
The prefix cache keys prompts by token ids, so the engine gives the Rust
scheduler, in place of an image's placeholder tokens, ids made from the
image's hash (`placeholder_ids`: at and above 2**31, outside every
vocabulary): the same image behind the same text hits the cache, another
image behind the same placeholders never does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

# Scheduler token ids of image placeholders start here (no vocabulary
# reaches it; ids are 32-bit in the Rust core).
PLACEHOLDER_BASE = 1 << 31


class ImageInput(msgspec.Struct, array_like=True, frozen=True):
    """One image of a prompt: its placeholder tokens `offset` .. `offset +
    length` of the prompt, its patch grid (t, h, w), and its pixel rows
    (float32, row-major, of `shape`), identified by `hash` (of rows and
    grid)."""

    hash: str
    offset: int
    length: int
    grid: list[int]
    shape: list[int]
    pixels: bytes

    def array(self) -> np.ndarray:
        return np.frombuffer(self.pixels, dtype=np.float32).reshape(self.shape)


class ImagePrompt(msgspec.Struct, frozen=True):
    """How a family's prompt holds an image, as its processor writes it:
    the chat template writes token `marker_id` once per image, which
    becomes `before`, the image token `image_token_id` once per placeholder,
    then `after` (pieces of text, or token ids written as their text), all
    before the prompt is tokenized. `tokens`: every image's placeholder
    count (0: each image's grid gives it)."""

    marker_id: int
    image_token_id: int
    before: list[int | str] = []
    after: list[int | str] = []
    tokens: int = 0


@dataclass
class ImagePiece:
    """Encoder rows `start` .. `start + count` of `image` fill the step's
    tokens `dst` .. `dst + count`."""

    image: ImageInput
    start: int
    count: int
    dst: int


@dataclass
class StepImages:
    """The step's rotary positions ([T], or [3, T] when image tokens run),
    the placeholder tokens its image pieces fill and, of a family whose
    image tokens attend both ways, each row's images as [start, end)
    positions (`AttentionMetadata.image_spans`)."""

    positions: np.ndarray
    pieces: list[ImagePiece]
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


def image_input(pixels: np.ndarray, grid: Sequence[int], offset: int, length: int) -> ImageInput:
    rows = np.ascontiguousarray(pixels, dtype=np.float32)
    grid = [int(g) for g in grid]
    digest = hashlib.sha256(rows.tobytes())
    digest.update(np.asarray(grid, dtype=np.int64).tobytes())
    return ImageInput(digest.hexdigest(), offset, length, grid, list(rows.shape), rows.tobytes())


def placeholder_ids(image_hash: str, length: int) -> np.ndarray:
    """The scheduler's ids for an image's `length` placeholder tokens: the
    hash's eight 31-bit words in turn, so any eight tokens of it carry 248
    bits of the image."""
    words = np.frombuffer(bytes.fromhex(image_hash)[:32], dtype=np.uint32) & 0x7FFF_FFFF
    return (np.resize(words, length).astype(np.int64)) + PLACEHOLDER_BASE


def expand_image_text(
    text: str, layout: ImagePrompt, token_text: Callable[[int], str], counts: Sequence[int]
) -> str:
    """The prompt's text with its k-th image marker written as the family's
    processor writes image k of `counts[k]` placeholders (`token_text`: a
    token id's text). The text must hold one marker per image (ValueError
    otherwise)."""
    marker = token_text(layout.marker_id)
    parts = text.split(marker)
    if len(parts) - 1 != len(counts):
        raise ValueError(
            f"the prompt has {len(parts) - 1} image placeholders ({marker}) for "
            f"{len(counts)} images"
        )

    def written(pieces: list[int | str]) -> str:
        return "".join(p if isinstance(p, str) else token_text(p) for p in pieces)

    before, after = written(layout.before), written(layout.after)
    image = token_text(layout.image_token_id)
    out = [parts[0]]
    for count, part in zip(counts, parts[1:], strict=True):
        out += [before, image * int(count), after, part]
    return "".join(out)


def image_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of image tokens in a prompt, in order."""
    ids = np.asarray(token_ids, dtype=np.int64)
    inside = np.concatenate(([False], ids == image_token_id, [False]))
    edges = np.flatnonzero(inside[1:] != inside[:-1])
    starts, ends = edges[0::2], edges[1::2]
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]
