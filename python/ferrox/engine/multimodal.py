"""Images in the engine: a request's images checked against the model, the
scheduler's view of its prompt (placeholders as hash ids, so the prefix
cache tells images apart), and, per step, what the runner needs for the
rows with images: M-RoPE positions and which encoder rows fill which
placeholder tokens of the step (prefill chunks may split an image).

The encoder itself runs in the runner, which keeps its output by image hash
(runner/encoder_cache.py): an image is encoded once for every chunk of its
placeholders and for a preempted request's recomputation, as long as the
cache holds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.multimodal import (
    ImageInput,
    ImagePiece,
    ImagePrompt,
    StepImages,
    placeholder_ids,
)
from ferrox.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferrox._native import BatchPlan
    from ferrox.engine.sequence import SequenceState


@dataclass
class RequestImages:
    """A request's images, and its M-RoPE positions ([3, prompt length],
    None for a family without M-RoPE) with the shift of every later token.
    `bidirectional`: the family's image tokens attend to each other both
    ways (each image is then an atomic span of the scheduler's)."""

    images: list[ImageInput]
    positions: np.ndarray | None
    delta: int
    bidirectional: bool = False

    def encoder_spans(self) -> list[tuple[int, int]]:
        """Each image's placeholders: the encoder rows a chunk reaching
        them needs (counted against the step's encoder budget)."""
        return [(i.offset, i.offset + i.length) for i in self.images]

    def atomic_spans(self) -> list[tuple[int, int]] | None:
        """The prompt ranges the scheduler computes in one chunk each."""
        return self.encoder_spans() if self.bidirectional else None


def image_prompt(model: Any) -> ImagePrompt | None:
    """How the model's prompts hold an image; None for a text-only model."""
    return model.image_prompt() if getattr(model, "supports_images", False) else None


def prepare_images(
    model: Any,
    prompt_ids: Sequence[int],
    images: Sequence[ImageInput],
    params: SamplingParams,
    limit: int | None,
) -> RequestImages:
    """Checks a request's images against the model and its prompt
    (InvalidArgumentError: a 400 naming what is wrong)."""
    if not getattr(model, "supports_images", False):
        raise InvalidArgumentError(
            f"this model ({type(model).__name__}) takes no images: its prompts are text only"
        )
    refusal = getattr(model, "image_refusal", None)
    if refusal is not None:
        raise InvalidArgumentError(refusal)
    if limit is not None and len(images) > limit:
        raise InvalidArgumentError(
            f"the prompt has {len(images)} images, more than limit_mm_per_prompt allows ({limit})"
        )
    if params.prompt_logprobs is not None:
        raise InvalidArgumentError("prompt_logprobs is not supported for prompts with images")
    n = len(prompt_ids)
    end = 0
    spans = []
    for k, image in enumerate(images):
        what = f"image {k}"
        if image.offset < end or image.length <= 0 or image.offset + image.length > n:
            raise InvalidArgumentError(
                f"{what}'s placeholder tokens [{image.offset}, {image.offset + image.length}) "
                f"overlap another image or leave the prompt of {n} tokens"
            )
        span = prompt_ids[image.offset : image.offset + image.length]
        if any(t != model.image_token_id for t in span):
            raise InvalidArgumentError(
                f"{what}'s placeholder tokens are not all the image token {model.image_token_id}"
            )
        why = model.check_image(image.grid, image.shape)
        if why is None and len(image.pixels) != 4 * int(np.prod(image.shape)):
            why = f"its pixel bytes ({len(image.pixels)}) do not fill float32 rows {image.shape}"
        if why is None and model.image_tokens(image.grid) != image.length:
            why = (
                f"its grid {image.grid} takes {model.image_tokens(image.grid)} placeholder "
                f"tokens, not {image.length}"
            )
        if why is not None:
            raise InvalidArgumentError(f"{what} cannot run: {why}")
        spans.append((image.offset, image.length, image.grid))
        end = image.offset + image.length
    positions, delta = None, 0
    if hasattr(model, "mrope_positions"):
        positions, delta = model.mrope_positions(n, spans)
    bidirectional = bool(getattr(model, "bidirectional_images", False))
    return RequestImages(list(images), positions, delta, bidirectional)


def scheduler_prompt(prompt_ids: Sequence[int], images: RequestImages | None) -> np.ndarray:
    """The prompt as the scheduler and its prefix cache see it: each image's
    placeholders replaced by ids made from its hash."""
    if images is None:
        return np.asarray(prompt_ids, dtype=np.int64)
    ids = np.array(prompt_ids, dtype=np.int64)  # (a copy: the placeholders change)
    for image in images.images:
        ids[image.offset : image.offset + image.length] = placeholder_ids(image.hash, image.length)
    return ids


def step_images(plan: BatchPlan, seqs: Mapping[int, SequenceState]) -> StepImages | None:
    """What the runner needs for this step's rows with images; None when
    no row has any."""
    rows = []
    for row, seq_id in enumerate(plan.req_ids.tolist()):
        seq = seqs.get(seq_id)
        if seq is not None and seq.request.images is not None:
            rows.append((row, seq))
    if not rows:
        return None
    qsl = plan.query_start_loc
    flat = plan.positions.astype(np.int64)  # (a copy)
    three: np.ndarray | None = None
    pieces: list[ImagePiece] = []
    spans: dict[int, list[tuple[int, int]]] = {}
    for row, seq in rows:
        images = seq.request.images
        assert images is not None
        lo, hi = int(qsl[row]), int(qsl[row + 1])
        if hi == lo:
            continue
        at = flat[lo:hi].copy()  # the tokens' indices in the sequence (contiguous)
        first, last = int(at[0]), int(at[-1]) + 1
        runs_images = False
        for image in images.images:
            start = max(first, image.offset)
            stop = min(last, image.offset + image.length)
            if start < stop:
                runs_images = True
                pieces.append(
                    ImagePiece(image, start - image.offset, stop - start, lo + start - first)
                )
                if images.bidirectional:
                    spans.setdefault(row, []).append((image.offset, image.offset + image.length))
        table = images.positions
        if table is None:
            continue
        n = table.shape[1]
        inside = at < n
        clipped = np.minimum(at, n - 1)
        flat[lo:hi] = np.where(inside, table[0, clipped], at + images.delta)
        if runs_images and three is None:
            three = np.stack([flat, flat, flat])
        if three is not None:
            three[:, lo:hi] = np.where(inside[None], table[:, clipped], at + images.delta)
    dtype = plan.positions.dtype
    positions = (three if three is not None else flat).astype(dtype, copy=False)
    return StepImages(np.ascontiguousarray(positions), pieces, spans)
