"""Structured outputs, one component: grammars compiled (and cached)
against the vocabulary, a step's masks computed while the model runs, the
matchers advanced by the sampled tokens."""

from ferrox.engine.structured_output.grammar import GrammarAdvance, GrammarEngine, PendingGrammar

__all__ = ["GrammarAdvance", "GrammarEngine", "PendingGrammar"]
