"""The vision encoder's outputs, by image hash: an image is encoded once for
all the prefill chunks its placeholders span, for a preempted request's
recomputation and for a later prompt with the same image, while the cache
holds it (least recently used dropped first, bounded in placeholder
tokens)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ferrox.common.multimodal import ImagePiece


class EncoderCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._tokens = 0
        self.num_encoded = 0  # images the encoder ran for (a measure of reuse)

    def features(
        self, model: Any, pieces: list[ImagePiece], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Each piece's image's placeholder embeddings [tokens, hidden]: from
        the cache, or encoded now (the step's missing images in one call)."""
        found: dict[str, torch.Tensor] = {}
        missing = {}
        for piece in pieces:
            key = piece.image.hash
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                found[key] = entry
            elif key not in missing:
                missing[key] = piece.image
        if missing:
            images = list(missing.values())
            pixels = torch.cat([torch.from_numpy(i.array().copy()) for i in images]).to(device)
            encoded = model.encode_images(pixels, [i.grid for i in images])
            start = 0
            for image in images:
                rows = encoded[start : start + image.length]
                start += image.length
                found[image.hash] = rows
                self._put(image.hash, rows)
            self.num_encoded += len(images)
        return found

    def _put(self, key: str, rows: torch.Tensor) -> None:
        size = rows.shape[0]
        if size > self.capacity:
            return
        while self._tokens + size > self.capacity:
            old, tensor = next(iter(self._entries.items()))
            self._entries.pop(old)
            self._tokens -= tensor.shape[0]
        self._entries[key] = rows
        self._tokens += size
