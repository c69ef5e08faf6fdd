"""A model's files without torch: hub ids and local paths, the bundled
default model, tokenizers (Hugging Face folders and GGUF metadata)."""

from ferrox.model_files.default import default_model_path

__all__ = ["default_model_path"]
