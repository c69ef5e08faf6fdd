"""Speculative decoding, one component: proposers (n-gram in the Rust
scheduler, a draft model), verification rows, the step-cost model."""

from ferrox.engine.speculation.draft_model import load_draft_model
from ferrox.engine.speculation.speculator import Speculator
from ferrox.engine.speculation.verification import sampling_rows

__all__ = ["Speculator", "load_draft_model", "sampling_rows"]
