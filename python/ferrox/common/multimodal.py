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
from collections.abc import Sequence
from dataclasses import dataclass

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
    """The step's rotary positions ([T], or [3, T] when image tokens run)
    and the placeholder tokens its image pieces fill."""

    positions: np.ndarray
    pieces: list[ImagePiece]


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


def expand_placeholders(
    token_ids: Sequence[int], image_token_id: int, lengths: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt with its k-th image token repeated `lengths[k]` times,
    and each image's (offset, length) there. The prompt must hold one image
    token per image (ValueError otherwise)."""
    ids = list(token_ids)
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(lengths):
        raise ValueError(f"the prompt has {len(at)} image placeholders for {len(lengths)} images")
    out: list[int] = []
    spans = []
    done = 0
    for index, length in zip(at, lengths, strict=True):
        out += ids[done:index]
        spans.append((len(out), int(length)))
        out += [image_token_id] * int(length)
        done = index + 1
    out += ids[done:]
    return out, spans
