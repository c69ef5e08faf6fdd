"""Model building blocks: norms, rotary embeddings, activations, attention."""
