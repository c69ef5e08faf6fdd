"""Reading checkpoints (safetensors, GGUF, random weights) into a model:
the files yield (name, tensor) pairs; the model family's file says where each goes."""
