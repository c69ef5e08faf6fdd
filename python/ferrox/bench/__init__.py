"""Benchmarks users can run: `ferrox bench serve` (load against any
OpenAI-compatible server) and `ferrox bench latency` (one batch, no server)."""
