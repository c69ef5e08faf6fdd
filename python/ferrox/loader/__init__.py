"""Model loaders: GGUF files and the bundled default model."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ferrox.loader.default import default_model_path

if TYPE_CHECKING:
    from ferrox.loader.gguf import GGUFModel, load_gguf


def __getattr__(name: str) -> Any:
    # The GGUF loader needs torch; `ferrox.loader.hub` and friends do not.
    if name in ("GGUFModel", "load_gguf"):
        return getattr(importlib.import_module("ferrox.loader.gguf"), name)
    raise AttributeError(f"module 'ferrox.loader' has no attribute {name!r}")


__all__ = ["GGUFModel", "default_model_path", "load_gguf"]
