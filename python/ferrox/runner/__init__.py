"""The model runner: batch plans to tensors, forward, sampling."""
