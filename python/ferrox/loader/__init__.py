"""Model loaders: GGUF files and the bundled default model."""

from ferrox.loader.default import default_model_path
from ferrox.loader.gguf import GGUFModel, load_gguf

__all__ = ["GGUFModel", "default_model_path", "load_gguf"]
