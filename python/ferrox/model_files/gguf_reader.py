"""Opening a GGUF file: its metadata and tensor views, without torch (the
frontend reads the tokenizer from here; `gguf.py` builds the model)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGUFReader

from ferrox.common.errors import ModelLoadError
from ferrox.model_files.gguf_tokenizer import build_tokenizer


class ArrayGGUFReader(GGUFReader):
    """`GGUFReader` over a plain ndarray view of its memory map. The reader slices the map once per
    metadata item, and slicing the `np.memmap` subclass costs far more than slicing an ndarray:
    this makes reading a 49k-token vocabulary about three times faster."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._array = np.asarray(mapped)  # the view keeps the map alive


def open_gguf(
    path: str | os.PathLike[str], mode: Literal["r", "c"] = "r"
) -> tuple[ArrayGGUFReader, dict[str, Any]]:
    """The reader and its metadata (`mode` "c": copy-on-write tensor views,
    writable, the file untouched)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = ArrayGGUFReader(path, mode=mode)
    except (OSError, ValueError, IndexError, KeyError) as exc:
        raise ModelLoadError(f"cannot read {path} as a GGUF file: {exc}") from exc
    return reader, {name: field.contents() for name, field in reader.fields.items()}


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Only the tokenizer of a GGUF file (its metadata; no tensor is read): a
    PreTrainedTokenizerFast."""
    _, metadata = open_gguf(path)
    return build_tokenizer(metadata)
