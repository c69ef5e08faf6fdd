"""Ranks, shard sizes, collectives and the step message of tensor parallelism,
and the torch device and dtype of an engine configuration."""
