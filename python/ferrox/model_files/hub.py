"""Where a model argument points: a local directory or file, the bundled
default model, or a Hugging Face hub id (`org/name`) resolved through the
local hub cache first, then the network unless `HF_HUB_OFFLINE` is set."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ferrox.common.errors import ModelLoadError
from ferrox.model_files.default import default_model_path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# What a model directory needs: no other weights formats, no checkpoints of other frameworks.
_ALLOW = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def is_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not model.endswith(".gguf")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cache_dir() -> str | None:
    """The hub cache as the environment names it now (huggingface_hub reads
    it once, at import)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return cache
    if home := os.environ.get("HF_HOME"):
        return str(Path(home) / "hub")
    return None


def resolve_model_path(model: str | None) -> Path:
    """The local path of `model` (None: the bundled default model)."""
    if model is None:
        return default_model_path()
    path = Path(model)
    if path.exists() or not is_hub_id(model):
        if not path.exists():
            raise ModelLoadError(
                f"model path {model!r} does not exist (give a Hugging Face model directory or "
                "hub id, a .gguf file, or no model for the bundled SmolLM2-135M-Instruct)"
            )
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = _cache_dir()
    try:
        return Path(
            snapshot_download(model, local_files_only=True, allow_patterns=_ALLOW, cache_dir=cache)
        )
    except LocalEntryNotFoundError:
        if _offline():
            raise ModelLoadError(
                f"{model!r} is not a local path and is not in the Hugging Face hub cache, and "
                "HF_HUB_OFFLINE is set: download it first or give a local path"
            ) from None
    try:
        return Path(snapshot_download(model, allow_patterns=_ALLOW, cache_dir=cache))
    except Exception as e:
        raise ModelLoadError(
            f"{model!r} is not a local path, not in the Hugging Face hub cache, and could not be "
            f"downloaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e
