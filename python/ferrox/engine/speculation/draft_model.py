"""The draft model of speculative decoding: loaded on the target's device
and dtype, checked against the target's vocabulary."""

from __future__ import annotations

import dataclasses

from ferrox.common.config import EngineConfig
from ferrox.common.errors import InvalidArgumentError
from ferrox.loader.model_loader import LoadedModel, load_model


def load_draft_model(config: EngineConfig, vocab_size: int) -> LoadedModel:
    """The draft model of `speculative_config`, on the target's device and dtype."""
    spec = config.speculation
    assert spec is not None and spec.model is not None
    draft_config = dataclasses.replace(
        config,
        model=spec.model,
        load_format=spec.load_format,
        tokenizer=None,
        # (the draft only proposes: the target's tokens decide the output)
        batch_invariant=False,
    )
    draft = load_model(draft_config)
    draft_vocab = int(draft.hf_config.vocab_size)
    if draft_vocab != vocab_size:
        raise InvalidArgumentError(
            f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's "
            f"({vocab_size}); a draft model must share the target's tokenizer"
        )
    return draft
