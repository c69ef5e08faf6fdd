"""Images from a request to the engine's `ImageInput`s, in the caller's
process (no torch here):

1. `load_image_bytes`: a data URL, or an http(s) URL fetched only from the
   operator's allowed domains, within a byte and a time limit;
2. `decode_image`: Pillow, refusing before decoding an image whose pixel
   count passes the limit (a decompression bomb), and a truncated or
   malformed file; RGB out;
3. `ImageProcessor`: the model's own transformers image processor
   (`AutoImageProcessor` of the model's folder). transformers imports
   torch, so a frontend that must stay without it (the server's, an
   AsyncLLM's) runs the processor in a child process
   (`python -m ferrox.frontend.media_worker`, msgpack over its pipes); the
   offline LLM, which has torch loaded already, runs it in-process;
4. `multimodal_prompt`: the prompt's image markers written out as the
   family's processor writes them (`ImagePrompt`: each image's tokens and
   what surrounds them), tokenized, and the images' `ImageInput`s (their
   rows, grid, hash and run of image tokens).

Every failure is an InvalidArgumentError that names the image (a 400).
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.multimodal import (
    ImageInput,
    ImagePrompt,
    expand_image_text,
    image_input,
    image_runs,
)


@dataclass(frozen=True)
class MediaLimits:
    """What one image may be: its encoded size, its pixels (checked from the
    header, before decoding), and, for an http(s) URL, its domain and the
    fetch's time."""

    max_bytes: int = 20 << 20
    max_pixels: int = 8192 * 8192
    fetch_timeout_s: float = 10.0
    allowed_domains: tuple[str, ...] = field(default_factory=tuple)


def load_image_bytes(url: str, limits: MediaLimits, what: str) -> bytes:
    """The bytes of an image URL (`what` names it in errors)."""
    if not isinstance(url, str) or not url:
        raise InvalidArgumentError(f"{what} has no URL")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidArgumentError(f"{what}: a data URL must be 'data:image/...;base64,<data>'")
        if not header[5:].startswith("image/"):
            raise InvalidArgumentError(f"{what}: the data URL is not an image ({header[5:]!r})")
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise InvalidArgumentError(f"{what} is larger than {limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidArgumentError(f"{what}: the data URL is not valid base64") from e
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise InvalidArgumentError(
            f"{what}: only data URLs and http(s) URLs are accepted, not {parsed.scheme!r}"
        )
    host = (parsed.hostname or "").lower()
    if host not in limits.allowed_domains:
        raise InvalidArgumentError(
            f"{what}: {host!r} is not an allowed media domain (the server fetches images only "
            "from --allowed-media-domains)"
        )
    return _fetch(url, limits, what)


def _fetch(url: str, limits: MediaLimits, what: str) -> bytes:
    import httpx

    try:
        with httpx.stream(
            "GET", url, timeout=limits.fetch_timeout_s, follow_redirects=False
        ) as response:
            if response.status_code != 200:
                raise InvalidArgumentError(f"{what}: fetching it answered {response.status_code}")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise InvalidArgumentError(f"{what} is larger than {limits.max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as e:
        raise InvalidArgumentError(f"{what}: cannot fetch it: {type(e).__name__}") from e


def decode_image(data: bytes, limits: MediaLimits, what: str) -> Any:
    """A PIL RGB image from encoded bytes, checked."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise InvalidArgumentError(f"{what} is larger than {limits.max_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
    except Exception as e:  # Pillow raises many kinds for a bad header
        raise InvalidArgumentError(f"{what} is not a readable image: {e}") from e
    if width * height > limits.max_pixels:
        raise InvalidArgumentError(
            f"{what} has {width} x {height} pixels, more than the limit of {limits.max_pixels}"
        )
    return checked_rgb(image, what)


def checked_rgb(image: Any, what: str) -> Any:
    """A PIL image decoded whole (a truncated one fails here) and in RGB."""
    try:
        image.load()
        return image.convert("RGB")
    except Exception as e:
        raise InvalidArgumentError(f"{what} is truncated or malformed: {e}") from e


@dataclass
class ProcessedImage:
    """The image processor's output for one image: pixel rows, patch grid,
    and the placeholder tokens it takes (0: the family's fixed count)."""

    pixels: np.ndarray
    grid: list[int]
    tokens: int


def run_processor(processor: Any, images: Sequence[Any]) -> list[ProcessedImage]:
    """The model's image processor over RGB images, image by image (its
    rows are one array for all of them)."""
    out = processor(images=list(images), return_tensors="np")
    pixels = np.asarray(out["pixel_values"], dtype=np.float32)
    if "image_grid_thw" not in out:
        # One fixed-size image per row of pixel_values [N, C, H, W]
        # (Gemma 3's); the family gives the placeholder count.
        crops = np.asarray(out.get("num_crops", [0]))
        if crops.any():
            raise ValueError("pan-and-scan crops are not supported")
        if pixels.ndim != 4 or len(pixels) != len(images):
            raise ValueError(f"unexpected pixel values of shape {list(pixels.shape)}")
        return [ProcessedImage(pixels[i : i + 1], [], 0) for i in range(len(images))]
    grids = np.asarray(out["image_grid_thw"], dtype=np.int64).tolist()
    merge = int(getattr(processor, "merge_size", 1))
    results, start = [], 0
    for grid in grids:
        patches = int(np.prod(grid))
        results.append(
            ProcessedImage(pixels[start : start + patches], grid, patches // (merge * merge))
        )
        start += patches
    return results


class ImageProcessor:
    """The model's image processor, in this process or in a child."""

    def __init__(self, model_dir: Path, in_process: bool) -> None:
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self._local: Any = None
        self._child: subprocess.Popen[bytes] | None = None
        if in_process:
            from transformers import AutoImageProcessor

            self._local = AutoImageProcessor.from_pretrained(str(model_dir))

    def process(self, images: Sequence[Any]) -> list[ProcessedImage]:
        """RGB PIL images -> their processed rows (one call at a time)."""
        if not images:
            return []
        with self._lock:
            if self._local is None:
                return self._remote(images)
            try:
                return run_processor(self._local, images)
            except Exception as e:  # the image's fault (its size, its aspect ratio)
                raise InvalidArgumentError(f"the image processor refused an image: {e}") from e

    def _remote(self, images: Sequence[Any]) -> list[ProcessedImage]:
        child = self._child
        if child is None or child.poll() is not None:
            child = self._child = subprocess.Popen(
                [sys.executable, "-m", "ferrox.frontend.media_worker", str(self.model_dir)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        request = [[img.width, img.height, img.tobytes()] for img in images]
        assert child.stdin is not None and child.stdout is not None
        try:
            write_frame(child.stdin, msgspec.msgpack.encode(request))
            reply = msgspec.msgpack.decode(read_frame(child.stdout))
        except (OSError, EOFError) as e:
            child.kill()
            self._child = None
            raise RuntimeError(f"the image processor process stopped: {e}") from e
        if isinstance(reply, str):
            raise InvalidArgumentError(f"the image processor refused an image: {reply}")
        return [
            ProcessedImage(
                np.frombuffer(rows, dtype=np.float32).reshape(shape), list(grid), int(tokens)
            )
            for rows, shape, grid, tokens in reply
        ]

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None


def write_frame(stream: Any, payload: bytes) -> None:
    stream.write(struct.pack("<Q", len(payload)) + payload)
    stream.flush()


def read_frame(stream: Any) -> bytes:
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("no reply")
    (size,) = struct.unpack("<Q", header)
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError("a short reply")
    return bytes(payload)


def multimodal_prompt(
    text: str,
    tokenizer: Any,
    layout: ImagePrompt,
    images: Sequence[ProcessedImage],
    add_special_tokens: bool,
) -> tuple[list[int], list[ImageInput]]:
    """The prompt's token ids, its image markers written out for each image
    before it is tokenized (as the family's processor does: the text around
    an image may tokenize with it), and the images as the engine takes them."""
    counts = [image.tokens or layout.tokens for image in images]
    try:
        text = expand_image_text(text, layout, tokenizer.convert_ids_to_tokens, counts)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from e
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    spans = image_runs(ids, layout.image_token_id)
    if [length for _, length in spans] != counts:
        raise InvalidArgumentError(
            f"the prompt's runs of image tokens {[n for _, n in spans]} do not match its "
            f"images' {counts} (does its text hold the image token itself?)"
        )
    inputs = [
        image_input(image.pixels, image.grid, offset, length)
        for image, (offset, length) in zip(images, spans, strict=True)
    ]
    return ids, inputs


def chat_images(
    messages: Sequence[dict[str, Any]], limits: MediaLimits
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The conversation as a chat template takes it (each image part a
    `{"type": "image"}`) and its images, decoded, in order. Image parts:
    `image_url` (a data URL, or an http(s) URL from an allowed domain),
    and the offline API's `image_pil` (a PIL image)."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            what = f"messages[{i}].content[{j}]"
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                data = load_image_bytes(url if isinstance(url, str) else "", limits, what)
                images.append(decode_image(data, limits, what))
            elif kind == "image_pil":
                images.append(checked_rgb(_pil(part.get("image_pil"), what), what))
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def _pil(image: Any, what: str) -> Any:
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise InvalidArgumentError(f"{what} must be a PIL image, got {type(image).__name__}")
    return image


def pil_images(value: Any, what: str) -> list[Any]:
    """`multi_modal_data["image"]` (one PIL image or a list of them) as
    checked RGB images."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [
        checked_rgb(_pil(image, f"{what}[{k}]"), f"{what}[{k}]") for k, image in enumerate(items)
    ]
